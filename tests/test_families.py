"""The family corpus: every diffusers pipeline family and causal-LM family a user may bring publishes `--no-push`,
verifies with a real forward on every load path, reloads alone from the output folder and runs (the card's own
usage snippet, executed), and gets a card that claims only what was checked.

The bases are tiny and built offline (publisher/testing/families.py). Three families that used to fail in three
different ways run in the fast tier; the rest are the slow tail (run by `make test` and CI). Timings: docs/families.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import SKIP_EVAL_AND_MATRIX, run_snippet

from publisher.testing.demo import card_snippets
from publisher.testing.families import FAMILIES

SMALL = ["--sample-steps", "2", "--sample-size", "64"]
FAST = {"pixart_sigma", "sdxl", "mixtral"}  # top-level parameter, SDXL's added_cond_kwargs, MoE manual path
OUTPUT = {"image": "sample.png", "video": "sample.mp4"}
# every card snippet (usage and the manual load path) also in a fresh interpreter, as pasted: a video pipeline
# (.frames, export_to_video), a top-level parameter (scale_shift_table) and transformers' MoE key conversion
FRESH_PROCESS = {"cogvideox", "pixart_sigma", "mixtral"}


def _params() -> list[Any]:
    return [pytest.param(name, id=name, marks=() if name in FAST else pytest.mark.slow) for name in FAMILIES]


# The CPU int4 recipes (IntxUnpackedToInt8Tensor) where they add coverage: a base stored in float32 (the tensor's .to()
# casts its bf16 scale with the model) with a layer whose in_features (80) its group size does not divide, excluded;
# and int8 dynamic activations over Linear layers with biases and tied embeddings.
CPU_INT4 = [pytest.param("sdxl", "intx4wo", ["--exclude", "add_embedding.linear_1"], id="sdxl-intx4wo", marks=pytest.mark.slow),
            pytest.param("qwen2", "int8dq-int4", [], id="qwen2-int8dq-int4", marks=pytest.mark.slow)]


def publish(cli: Any, family: str, tmp_path: Path, *extra: str, token: str | None = None,
            quant: str = "int8wo") -> tuple[dict[str, Any], Path, Any]:
    from publisher.testing.families import build_family

    base = build_family(family, tmp_path / "base" / family)
    out = tmp_path / "out"
    result = cli(str(base), "--quant", quant, "--no-push", "--output-dir", str(out), "--json", *SMALL, *extra, token=token)
    data = json.loads(result.stdout) if result.exit_code == 0 else {}
    return data, out, result


def usage_snippet(card: str) -> str:
    return next(code for kind, code in card_snippets(card) if kind == "usage")


def run_snippets(card: str, cwd: Path) -> None:
    """Every Python block of the card in its own fresh interpreter (helpers.run_snippet: the config block, usage,
    offload, the manual path), but the torch.compile block: its text is one template per kind (a pipeline's denoiser, an LM's forward) with the
    usage snippet's call, run as pasted for the tiny FLUX and Llama (tests/test_stages_card.py::
    test_every_card_snippet_runs); compiling each family's model again costs a minute or more of CPU per family."""
    import os

    cwd.mkdir()
    # the user's environment, no token: also the verification's, so the snippets fork from the zygote its load paths
    # used (PYTHONWARNINGS=ignore here used to start one more per worker, about 4 s of imports)
    env = dict(os.environ)
    env.pop("HF_TOKEN", None)
    kinds, snippets = zip(*card_snippets(card))
    pipeline = "from diffusers import" in snippets[1]
    assert list(kinds) == ["config", "usage", *(["offload"] if pipeline else []), "compile", "manual-load"], kinds
    for i, (kind, code) in enumerate(zip(kinds, snippets)):
        if kind == "compile":
            continue
        proc = run_snippet(code, cwd, env, timeout=600)
        assert proc.returncode == 0, f"snippet {i} failed:\n{code}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("family", _params())
def test_family_publishes_verifies_reloads_and_runs(cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     family: str) -> None:
    extra = ["--allow-unquantized"] if family == "gpt2" else []  # GPT-2's Conv1D layers: nothing to quantize
    check_family(cli, tmp_path, monkeypatch, family, "int8wo", [*extra, *SKIP_EVAL_AND_MATRIX])


@pytest.mark.parametrize(("family", "quant", "extra"), CPU_INT4)
def test_cpu_int4_recipes_publish_verify_reload_and_run(cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        family: str, quant: str, extra: list[str]) -> None:
    data = check_family(cli, tmp_path, monkeypatch, family, quant, [*extra, *SKIP_EVAL_AND_MATRIX])
    assert data["components"][0]["tensor_classes"] == {"IntxUnpackedToInt8Tensor": data["components"][0]["quantized_layers"]}
    card = (tmp_path / "out" / "README.md").read_text()
    assert "int4 values stored unpacked, one per int8 byte" in card  # the card is honest about the storage


def check_family(cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str, quant: str,
                 extra: list[str]) -> dict[str, Any]:
    """Publish ``family`` with ``quant``; every load path, a real forward, the card's claims and its snippets."""
    data, out, result = publish(cli, family, tmp_path, *extra, quant=quant)
    assert result.exit_code == 0, result.output
    report = data["verification"]
    assert report["passed"] and data["verified"]
    for name, forward in report["forward"].items():  # a real forward for every quantized component
        assert not forward["weights_only"], f"{name}: {forward['reason']}"
    assert {r["path"] for r in report["results"]} == {"library", "manual"}
    for r in report["results"]:
        assert r["ok"] and r["applicable"] and r["forward_checked"] and r["max_abs_diff"] == 0.0, r
        assert r["quantized_layers"] == report["expected_layers"][r["component"] or "model"], r
    assert report["tensor_class"] in data["components"][0]["tensor_classes"] or family == "gpt2"
    assert {q["component"] for q in data["quality"]} == set(report["forward"])  # figures for every dtype of base
    assert all(q["cosine"] > 0.99 for q in data["quality"])
    layers = data["components"][0]["layers"]
    assert (layers["quantized"] > 0) is (family != "gpt2")
    card = (out / "README.md").read_text()
    assert "your-username" not in card and "weights only" not in card.split("## Verification")[1].split("|---")[0]
    assert data["repo_id"] is None and "no repo id was chosen" in data["repo_id_note"]  # no token, no --repo-id
    assert "**Repo id:** none was chosen" in card
    if family == "gpt2":
        assert "published as it was, at the user's request (--allow-unquantized)" in card
    if layers["quantized"] and any(k["kind"] == "experts" for k in layers["kept"]):
        assert "**MoE experts stay bf16.**" in card
    # reloaded alone (the base is gone) and run: the card's usage snippet, as a user would paste it; for the families
    # in FRESH_PROCESS in a fresh interpreter with every other snippet, for the others in this one
    for p in (tmp_path / "base").iterdir():
        p.rename(p.with_name(p.name + "-gone"))
    if family in FRESH_PROCESS:
        run_snippets(card, tmp_path / "fresh")
        ran_in = tmp_path / "fresh"
    else:
        monkeypatch.chdir(tmp_path)
        exec(compile(usage_snippet(card), f"<{family} card>", "exec"), {"__name__": "__card__"})
        ran_in = tmp_path
    kind = FAMILIES[family].kind
    if kind in OUTPUT:
        assert (ran_in / OUTPUT[kind]).stat().st_size > 0
    return data
