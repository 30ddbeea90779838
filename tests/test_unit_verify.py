"""The outcome of one reload from a canned worker result (the JSON publisher/loadpath.py writes): no model is loaded.

``compare`` decides pass, fail or silently wrong; the report built from its results decides the push. The cases with
per-layer classes from the config (``Expected.classes``) and a load that raised after loading are in
tests/test_verify_peers.py; test_verify_full.py runs real reloads.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import unit_fixtures as uf

LAYERS = ["blocks.0.attn.to_q", "blocks.0.attn.to_k", "proj_out"]
DIGESTS = {f"{n}.weight": f"sha-{i}" for i, n in enumerate(LAYERS)} | {"norm.weight": "sha-norm", "norm_out.linear.weight": "sha-kept"}


@pytest.fixture(scope="module", autouse=True)
def _torch() -> None:
    """torch, safetensors and torchao (the recipes' configs) imported once (seconds) before the first test: the tests
    measure compare, not imports."""
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401

    from publisher import recipes

    recipes.get("int8wo")


def _expected(tmp_path: Path, output: Any = "default", **extra: Any) -> Any:
    import torch

    from publisher.handoffs.report import Expected

    if isinstance(output, str):
        output = torch.linspace(-1, 1, 12, dtype=torch.bfloat16).reshape(1, 3, 4)
    return Expected("transformer", "diffusers", "FluxTransformer2DModel", tmp_path / "inputs.safetensors", output,
                    dict(DIGESTS), list(LAYERS), **extra)


def _worker(tmp_path: Path, output: Any = "same", **changes: Any) -> dict[str, Any]:
    """What the worker writes after a load that raised nothing: every planned layer an Int8Tensor, the tensors
    as recorded, and its forward's output in a safetensors file (``output``: "same", a tensor, or None)."""
    from safetensors.torch import save_file

    data: dict[str, Any] = {"path": "library", "component": "transformer", "versions": dict(uf.VERSIONS), "loaded": True,
                            "linear_classes": {**{n: "Int8Tensor" for n in LAYERS}, "norm_out.linear": "Parameter"},
                            "digests": dict(DIGESTS), "nonfinite": None, "ok": True}
    if output is not None:
        tensor = _expected(tmp_path).output.clone() if isinstance(output, str) else output
        out = tmp_path / "out.safetensors"
        save_file({"output": tensor}, str(out))
        data["output"] = str(out)
    return data | changes


def _compare(exp: Any, data: dict[str, Any], tensor_class: str | None = "Int8Tensor", env: str = "current") -> Any:
    from publisher.verify.full import compare

    return compare(exp, data, "library", env, "/usr/bin/python3", tensor_class)


def test_a_bit_identical_reload_passes(tmp_path: Path) -> None:
    r = _compare(_expected(tmp_path), _worker(tmp_path))
    assert (r.outcome, r.ok, r.silent, r.applicable) == ("pass", True, False, True)
    assert r.max_abs_diff == 0.0 and r.forward_checked and r.detail == ""
    assert r.tensors_checked == len(DIGESTS) and r.quantized_layers == len(LAYERS)
    assert r.class_found == "Int8Tensor" and r.classes_found == {"Int8Tensor": 3}
    assert (r.component, r.path, r.env, r.versions) == ("transformer", "library", "current", uf.VERSIONS)


def test_weights_only_passes_without_an_output(tmp_path: Path) -> None:
    r = _compare(_expected(tmp_path, output=None), _worker(tmp_path, output=None))
    assert r.outcome == "pass" and r.max_abs_diff is None and not r.forward_checked


def test_a_layer_of_another_class_is_silently_wrong(tmp_path: Path) -> None:
    data = _worker(tmp_path)
    data["linear_classes"]["blocks.0.attn.to_k"] = "Float8Tensor"
    r = _compare(_expected(tmp_path), data)
    assert (r.outcome, r.silent, r.ok) == ("silently wrong", True, False)
    assert r.detail == ("loads without an error, but 2 of 3 planned layers are of the class their config implies (layer "
                        "blocks.0.attn.to_k is Float8Tensor, Int8Tensor expected)")
    assert r.classes_found == {"Int8Tensor": 2, "Float8Tensor": 1} and r.class_found == "Int8Tensor, Float8Tensor"
    assert not r.forward_checked  # decided before the output is read


def test_without_a_tensor_class_any_torchao_class_will_do(tmp_path: Path) -> None:
    """A recipe whose layers differ (per-layer configs) names no single class: a plain Parameter is still wrong."""
    data = _worker(tmp_path)
    data["linear_classes"]["proj_out"] = "IntxUnpackedToInt8Tensor"
    assert _compare(_expected(tmp_path), data, tensor_class=None).outcome == "pass"
    data["linear_classes"]["proj_out"] = "Parameter"
    r = _compare(_expected(tmp_path), data, tensor_class=None)
    assert r.outcome == "silently wrong" and "(layer proj_out is Parameter, a torchao tensor expected)" in r.detail


def test_a_missing_layer_and_an_unplanned_quantized_layer(tmp_path: Path) -> None:
    data = _worker(tmp_path)
    del data["linear_classes"]["proj_out"]
    r = _compare(_expected(tmp_path), data)
    assert r.outcome == "silently wrong" and "(layer proj_out is None, Int8Tensor expected)" in r.detail
    assert r.classes_found == {"Int8Tensor": 2, "missing": 1}
    # a layer the plan kept comes back quantized: its tensor is not the one recorded
    data = _worker(tmp_path, digests=dict(DIGESTS, **{"norm_out.linear.weight": "sha-int8"}))
    data["linear_classes"]["norm_out.linear"] = "Int8Tensor"
    r = _compare(_expected(tmp_path), data)
    assert r.outcome == "silently wrong" and r.detail == ("loads without an error, but 1 layers are quantized that were not "
                                                          "planned (layer norm_out.linear is Int8Tensor)")
    assert r.quantized_layers == 4
    # with no digests to compare (verify TARGET's library path as the reference), the layer alone tells it
    exp = _expected(tmp_path)
    exp.digests = {}
    r = _compare(exp, data)
    assert r.outcome == "silently wrong" and "1 layers are quantized that were not planned" in r.detail
    r = _compare(_expected(tmp_path), dict(data, ok=False, error="RuntimeError: shapes"))
    assert r.outcome == "fail" and r.detail == ("it loaded, but 1 layers are quantized that were not planned (layer "
                                                "norm_out.linear is Int8Tensor); then it raised RuntimeError: shapes")


def test_an_output_that_differs_is_silently_wrong_with_its_max_abs_diff(tmp_path: Path) -> None:
    exp = _expected(tmp_path)
    off = exp.output.clone()
    off[0, 1, 2] += 0.5
    r = _compare(exp, _worker(tmp_path, output=off))
    assert r.outcome == "silently wrong" and r.forward_checked
    assert r.max_abs_diff == pytest.approx(0.5, abs=0.02)
    assert r.detail == f"output differs from the in-memory quantized model (max abs diff {r.max_abs_diff:.3g})"


def test_an_output_of_another_shape_or_dtype_is_silently_wrong(tmp_path: Path) -> None:
    import torch

    exp = _expected(tmp_path)
    r = _compare(exp, _worker(tmp_path, output=exp.output.float()))
    assert r.outcome == "silently wrong"
    assert r.detail == "output shape/dtype (1, 3, 4)/torch.float32 != (1, 3, 4)/torch.bfloat16"
    r = _compare(exp, _worker(tmp_path, output=torch.zeros(1, 4, dtype=torch.bfloat16)))
    assert r.detail == "output shape/dtype (1, 4)/torch.bfloat16 != (1, 3, 4)/torch.bfloat16"


def test_tensors_that_differ_or_go_missing_are_silently_wrong(tmp_path: Path) -> None:
    exp = _expected(tmp_path, reference="the in-memory quantized tensors")
    digests = dict(DIGESTS, **{"proj_out.weight": "sha-other"})
    r = _compare(exp, _worker(tmp_path, digests=digests))
    assert r.outcome == "silently wrong" and r.detail == "tensor proj_out.weight differs from the in-memory quantized tensors"
    assert r.max_abs_diff is None  # the output is not read once a tensor differs
    digests = {k: v for k, v in DIGESTS.items() if k != "norm.weight"}
    assert _compare(exp, _worker(tmp_path, digests=digests)).detail == "tensor norm.weight missing after reload"
    r = _compare(exp, _worker(tmp_path, digests=dict(DIGESTS, extra="sha-new")))
    assert r.outcome == "silently wrong" and r.detail == "unexpected tensor extra after reload"
    tied = dict(DIGESTS, **{"lm_head.weight": DIGESTS["proj_out.weight"]})  # a tied weight is saved once
    assert _compare(exp, _worker(tmp_path, digests=tied)).outcome == "pass"


def test_a_non_finite_output_is_silently_wrong(tmp_path: Path) -> None:
    r = _compare(_expected(tmp_path), _worker(tmp_path, nonfinite={"layer": "blocks.0.attn.to_k", "what": "inf"}))
    assert r.outcome == "silently wrong" and r.forward_checked
    assert r.detail == "the output holds non-finite values (inf), first produced by layer blocks.0.attn.to_k"
    r = _compare(_expected(tmp_path), _worker(tmp_path, nonfinite={"layer": "", "what": "NaN"}))
    assert r.detail == "the output holds non-finite values (NaN)"


def test_an_error_while_loading_is_a_failure(tmp_path: Path) -> None:
    """The worker's record of a load that raised: no linear_classes, the error, the versions it ran with."""
    data = {"path": "library", "component": "transformer", "versions": {"torch": "2.9.0"}, "ok": False,
            "error": "OSError: no file named diffusion_pytorch_model.safetensors", "traceback": "..."}
    r = _compare(_expected(tmp_path), data, env="/opt/old/bin/python")
    assert (r.outcome, r.ok, r.silent, r.applicable) == ("fail", False, False, True)
    assert r.detail == "OSError: no file named diffusion_pytorch_model.safetensors"
    assert r.env == "/opt/old/bin/python" and r.versions == {"torch": "2.9.0"} and r.quantized_layers == 0
    # an error after a load of the right classes is that error alone
    r = _compare(_expected(tmp_path), _worker(tmp_path, ok=False, error="RuntimeError: out of memory"))
    assert r.outcome == "fail" and r.detail == "RuntimeError: out of memory" and r.quantized_layers == 3
    # what run_worker records when the interpreter could not even start
    r = _compare(_expected(tmp_path), {"ok": False, "error": "interpreter /nope cannot run: No such file or directory"})
    assert r.outcome == "fail" and r.versions == {} and r.detail.startswith("interpreter /nope cannot run")


def test_a_path_that_does_not_apply_is_not_a_failure(tmp_path: Path) -> None:
    data = {"path": "manual", "component": "transformer", "versions": dict(uf.VERSIONS), "ok": False,
            "not_applicable": True, "error": "the checkpoint is a pickle torch refuses"}
    r = _compare(_expected(tmp_path), data)
    assert not r.applicable and not r.ok and r.detail == "the checkpoint is a pickle torch refuses"
    ok = _compare(_expected(tmp_path), _worker(tmp_path))
    report = uf.report_for(_artifacts(tmp_path), [ok, r])
    assert report.failures() == [] and report.passed and report.summary() == "2 load checks passed"


def _artifacts(tmp_path: Path) -> Any:
    return uf.pipeline_publish(tmp_path / "repo")[1]


def test_failures_and_summary_of_a_report(tmp_path: Path) -> None:
    exp = _expected(tmp_path)
    wrong = _worker(tmp_path)
    wrong["linear_classes"]["proj_out"] = "Parameter"
    results = [_compare(exp, _worker(tmp_path)), _compare(exp, wrong, env="diffusers==0.38.0"),
               _compare(exp, {"ok": False, "error": "ImportError: torchao"}, env="torchao==0.15.0")]
    report = uf.report_for(_artifacts(tmp_path), results)
    assert [r.outcome for r in report.failures()] == ["silently wrong", "fail"] and not report.passed
    assert report.summary() == ("transformer via the library path (diffusers==0.38.0): silently wrong: loads without an "
                                "error, but 2 of 3 planned layers are of the class their config implies (layer proj_out "
                                "is Parameter, Int8Tensor expected)")
    report.compat = results
    assert report.compat_counts() == "1 pass, 1 fail, 1 silently wrong"
    report.results = results[2:]
    assert report.summary() == "transformer via the library path (torchao==0.15.0): ImportError: torchao"


def test_the_report_round_trips_through_verification_json(tmp_path: Path) -> None:
    """verification.json holds every field of every result (and its outcome), but not the in-memory expected records."""
    from publisher.handoffs.report import REPORT_NAME, ForwardInputs, PathResult

    exp = _expected(tmp_path)
    off = exp.output.clone()
    off[0, 0, 0] += 1
    results = [_compare(exp, _worker(tmp_path)), _compare(exp, _worker(tmp_path, output=off))]
    report = uf.report_for(_artifacts(tmp_path), results, expected=[exp], notes=["a note"])
    report.forward["text_encoder_2"] = ForwardInputs(None, "", "no pipeline run recorded this component's call")
    path = report.write(tmp_path)
    assert path == tmp_path / REPORT_NAME
    saved = json.loads(path.read_text())
    assert saved == json.loads(json.dumps(report.to_dict())) and "expected" not in saved
    assert saved["passed"] is False and saved["notes"] == ["a note"] and saved["recipe"] == "int8wo"
    assert [r["outcome"] for r in saved["results"]] == ["pass", "silently wrong"]
    assert saved["forward"]["text_encoder_2"] == {"inputs": None, "weights_only": True,
                                                  "reason": "no pipeline run recorded this component's call"}
    assert saved["forward"]["transformer"] == {"inputs": "token ids (seeded)", "weights_only": False, "reason": None}
    names = {f.name for f in fields(PathResult)}
    rebuilt = [PathResult(**{k: v for k, v in r.items() if k in names}) for r in saved["results"]]
    assert rebuilt == results and set(saved["results"][0]) == names | {"outcome"}
