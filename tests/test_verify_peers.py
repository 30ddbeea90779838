"""`verify` on checkpoints other people made, and `publish` of an already-quantized base (issue 22).

The corpus (publisher/testing/peers.py) is built once per module by the libraries' own documented calls. The unit tier
checks each entry's expected verdict in this process (what its files hold against its declared config, the stored
values, and the base re-quantized with that config); the slow tier runs the real CLI on the rows of the issue's table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import seed

from publisher.errors import SourceError
from publisher.testing.peers import CORPUS, FLUX_LAYER, LLAMA_LAYER, PEERS, Peer, build_peer
from publisher.verify import against_base, target_layout
from publisher.verify.target import base_row, check_files

WITH_FILES = [p for p in CORPUS if p.name != "tf-undeclared"]


BASES: dict[str, Path] = {}  # the tiny bases the corpus was made from, by kind (filled by the corpus fixture)


@pytest.fixture(scope="module")
def corpus(tiny_flux_dir: Path, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peers")
    BASES.update(llama=tiny_llama_dir, flux=tiny_flux_dir)
    made: dict[str, Path] = {}
    for peer in CORPUS:
        build_peer(peer.name, root / peer.name, BASES, made)
    return made


def _files_verdict(folder: Path, name: str) -> tuple[list[Any], list[Any]]:
    """(components, content rows) of one checkpoint, checked in this process."""
    comps = target_layout.components(folder, name)
    rows = []
    checks = []
    for comp in comps:
        decl, check, found = check_files(comp, folder, name)
        rows += found
        checks.append((comp, decl, check))
    return checks, rows


@pytest.mark.parametrize("peer", CORPUS, ids=lambda p: p.name)
def test_files_against_the_declared_config(corpus: dict[str, Path], peer: Peer) -> None:
    folder = corpus[peer.name]
    if peer.name == "tf-undeclared":
        with pytest.raises(SourceError, match=peer.says):
            target_layout.components(folder, peer.name)
        return
    checks, rows = _files_verdict(folder, peer.name)
    if peer.layout == "pipeline":
        assert {(c.name, c.library) for c, _, _ in checks} == {("transformer", "diffusers"), ("text_encoder_2", "transformers")}
    else:
        library = "diffusers" if peer.layout == "diffusers-model" else "transformers"
        assert [(c.name, c.library) for c, _, _ in checks] == [("", library)]
    failed = [r for r in rows if not r.ok]
    assert (not failed) == (peer.verdict == "pass"), [r.detail for r in failed]
    if failed:
        assert peer.says in failed[0].detail
    assert all(check.checked > 0 for _, _, check in checks) or failed  # a good checkpoint's layers were all compared


def test_a_mismatch_names_the_layer_the_config_and_the_file(corpus: dict[str, Path]) -> None:
    _, rows = _files_verdict(corpus["tf-float8-as-int8wo"], "x")
    detail = next(r.detail for r in rows if not r.ok)
    assert detail.startswith("layer model.layers.0.mlp.down_proj: the config says Int8WeightOnlyConfig (the quant_type): "
                             "Int8Tensor (qdata int8")
    assert "the file holds Float8Tensor (qdata float8_e4m3fn" in detail and "per row" in detail


def test_per_layer_configs_are_checked_layer_by_layer(corpus: dict[str, Path]) -> None:
    """The release recipe: ModuleFqnToConfig's _default for every Linear, its own entry for the embeddings."""
    checks, rows = _files_verdict(corpus["tf-release-own-head"], "x")
    (_, decl, check), = checks
    assert decl is not None and decl.per_layer
    assert check.classes["model.embed_tokens"] == "IntxUnpackedToInt8Tensor"
    assert check.classes[f"{LLAMA_LAYER}"] == "IntxUnpackedToInt8Tensor" and check.dtype == "float32"
    assert all(r.ok for r in rows)
    # transformers' untie_embedding_weights leaves lm_head unquantized: said, not failed
    assert any("lm_head" in n for r in rows for n in r.notes)
    # a layer whose group size differs from its config's fails, naming both
    from publisher.verify import declared, stored

    folder = corpus["tf-release-own-head"]
    found = stored.describe_files(folder, "safetensors")
    entry = found.tensors[f"{LLAMA_LAYER}.weight"]
    entry.data["block_size"] = [1, 64]
    comp = target_layout.components(folder, "x")[0]
    from publisher.loadpath import meta_model

    result = declared.check(comp, decl, found, meta_model(comp.library, comp.class_name, comp.config))
    assert result.problems and result.problems[0].startswith(f"layer {LLAMA_LAYER}: the config says "
                                                             "Int8DynamicActivationIntxWeightConfig (its _default)")
    assert "group size 32" in result.problems[0] and "group size 64" in result.problems[0]


@pytest.mark.parametrize("peer", WITH_FILES, ids=lambda p: p.name)
def test_against_the_base(corpus: dict[str, Path], peer: Peer) -> None:
    """--base: the base re-quantized with the declared config, tensor for tensor."""
    folder = corpus[peer.name]
    base_dir = BASES[peer.base]
    base = against_base.Base(str(base_dir), "--base", base_dir)
    checks, rows = _files_verdict(folder, peer.name)
    for comp, decl, check in checks:
        assert decl is not None
        row, reference, _ = base_row(comp, decl, check, base, None, folder, peer.name, None)
        rows.append(row)
        if peer.with_base == "pass":
            assert row.ok and reference is not None and row.detail.startswith("all "), row.detail  # bit for bit
    failed = [r for r in rows if not r.ok]
    assert (not failed) == (peer.with_base == "pass"), [r.detail for r in failed]
    if peer.name in ("tf-zero-scale", "tf-sign-flip"):
        row = next(r for r in failed if r.what == "against the base")
        assert row.detail.startswith(f"tensor {LLAMA_LAYER}.weight: quantization error ")
        assert "1 of 21 tensors not bit-identical" in row.detail
    if peer.name == "tf-release-own-head":  # transformers' untie copied embed_tokens into lm_head: the re-quantization too
        assert failed[0].detail.endswith("(the base re-quantized holds it too: the library's loader changed it)")


def test_a_named_base_that_cannot_be_reached_is_a_reason_and_an_explicit_one_an_error(hub: Any, tmp_path: Path) -> None:
    base, why = against_base.find(None, "nobody/no-such-base", "its card (base_model)", None, None)
    assert base is None and why.startswith("the base nobody/no-such-base named by its card (base_model) cannot be reached (")
    with pytest.raises(SourceError, match=r"^--base nobody/no-such-base cannot be read \("):
        against_base.find("nobody/no-such-base", None, "", None, None)
    assert against_base.find(None, None, "", None, None) == (None, "no base named: no --base, and no base_model in its "
                                                                 "card or hf_ao_publish.json")
    local, _ = against_base.find(str(tmp_path), None, "", None, None)
    assert local is not None and local.folder == tmp_path.resolve() and local.origin == "--base"


def test_a_local_base_is_found_by_its_folder_name_where_the_state_file_names_it(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A publish names a local base by its folder's name (never its path): `verify` finds it next to the working
    directory, says where it is not, and takes it as the base the target was made from (bit for bit)."""
    state = {"base_model": "my-llama", "base_sha": "local-" + "0" * 40}
    monkeypatch.chdir(tmp_path)
    base, why = against_base.find(None, "my-llama", "its hf_ao_publish.json", state, None)
    assert base is None and why == ("the base my-llama named by its hf_ao_publish.json is a local folder, and there is "
                                    "none of that name here; give its path with --base")
    (tmp_path / "models" / "my-llama").mkdir(parents=True)
    explicit, _ = against_base.find(str(tmp_path / "models" / "my-llama"), "my-llama", "its hf_ao_publish.json", state, None)
    assert explicit is not None and explicit.named_by("my-llama") and not explicit.named_by("meta/my-llama")
    assert explicit.named_by(str(tmp_path / "models" / "my-llama"))  # a state file of an earlier release: the path
    monkeypatch.chdir(tmp_path / "models")
    found, _ = against_base.find(None, "my-llama", "its hf_ao_publish.json", state, None)
    assert found is not None and found.folder == tmp_path / "models" / "my-llama" and found.named_by("my-llama")


def test_a_class_this_library_does_not_have_is_one_line(corpus: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(corpus["flux-model"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "_class_name": "FluxTransformer9DModel"}))
    with pytest.raises(SourceError, match="is a FluxTransformer9DModel, which diffusers .* has no model class for"):
        target_layout.components(folder, str(folder))


def test_pickled_weights_load_by_hand_with_weights_only(corpus: dict[str, Path]) -> None:
    """The manual path of a pickle .bin (weights_only=True) gives the library path's tensors."""
    from publisher import loadpath

    folder = corpus["flux-pipeline-bin"] / "transformer"
    manual = loadpath.inspect_model(loadpath.load_manual("diffusers", "FluxTransformer2DModel", folder))
    library = loadpath.inspect_model(loadpath.load_component("diffusers", "FluxTransformer2DModel", folder))
    assert manual == library
    assert manual["linear_classes"][FLUX_LAYER] == "Int8Tensor"


def test_a_pickle_torch_refuses_is_not_checked_and_not_unpickled(tmp_path: Path) -> None:
    import pickle

    from publisher import loadpath
    from publisher.verify import stored

    (tmp_path / "diffusion_pytorch_model.bin").write_bytes(pickle.dumps({"x": _NotATensor()}))
    found = stored.describe_files(tmp_path, "pickle")
    assert not found.tensors and "torch's weights-only loader refuses diffusion_pytorch_model.bin" in found.not_checked[0]
    assert found.not_checked[0].endswith("not unpickled any other way, so its tensors were not checked")
    with pytest.raises(loadpath.NotApplicable, match="not unpickled any other way"):
        loadpath.read_pickled(tmp_path)


class _NotATensor:
    """A global torch's weights-only unpickler refuses."""


# ------------------------------------------------------------------------- the outcome of one load (compare)


def _exp(classes: dict[str, str]) -> Any:
    from publisher.handoffs.report import Expected

    return Expected("", "transformers", "LlamaForCausalLM", None, None, {"a": "1"}, sorted(classes), "the library path",
                    classes=classes)


def test_the_expected_class_is_the_one_the_config_implies() -> None:
    from publisher.verify.full import compare

    exp = _exp({"q": "IntxUnpackedToInt8Tensor", "emb": "IntxUnpackedToInt8Tensor"})
    data = {"ok": True, "linear_classes": {"q": "IntxUnpackedToInt8Tensor", "emb": "IntxUnpackedToInt8Tensor", "lm_head": "Parameter"},
            "digests": {"a": "1"}}
    result = compare(exp, data, "library", "current", "python", None)
    assert result.outcome == "pass" and not result.silent and result.class_found == "IntxUnpackedToInt8Tensor"
    data["linear_classes"]["q"] = "Parameter"  # loaded unquantized, without an error
    result = compare(exp, data, "library", "torchao==0.15.0", "python", None)
    assert result.outcome == "silently wrong" and result.silent
    assert "1 of 2 planned layers are of the class their config implies (layer q is Parameter, " in result.detail
    assert result.classes_found == {"IntxUnpackedToInt8Tensor": 1, "Parameter": 1}


def test_a_load_that_raised_is_a_failure_not_silently_wrong() -> None:
    from publisher.verify.full import compare

    data = {"ok": False, "linear_classes": {"q": "Parameter"}, "error": "RuntimeError: expected m1 and m2 to have the same dtype"}
    result = compare(_exp({"q": "Int8Tensor"}), data, "library", "current", "python", None)
    assert result.outcome == "fail" and not result.silent
    assert result.detail == ("it loaded, but 0 of 1 planned layers are of the class their config implies (layer q is "
                             "Parameter, Int8Tensor expected); then it raised RuntimeError: expected m1 and m2 to have the "
                             "same dtype")
    data = {"ok": False, "error": "TypeError: Int8Tensor.__new__() got an unexpected keyword argument 'reduce_range'"}
    assert compare(_exp({"q": "Int8Tensor"}), data, "library", "torchao==0.17.0", "python", None).outcome == "fail"


def test_non_finite_outputs_are_named_with_their_first_layer() -> None:
    from publisher.verify.full import compare

    data = {"ok": True, "linear_classes": {"q": "Int8Tensor"}, "digests": {"a": "1"},
            "nonfinite": {"layer": "model.layers.0.self_attn.q_proj", "what": "NaN"}}
    result = compare(_exp({"q": "Int8Tensor"}), data, "manual", "current", "python", None)
    assert result.outcome == "silently wrong"
    assert result.detail == "the output holds non-finite values (NaN), first produced by layer model.layers.0.self_attn.q_proj"


def test_a_nan_a_later_kernel_drops_is_named_all_the_same() -> None:
    from publisher.verify.full import compare

    data = {"ok": True, "linear_classes": {"q": "Int8Tensor"}, "digests": {"a": "1"},
            "nonfinite": {"layer": "model.layers.0.self_attn.q_proj", "what": "NaN", "output": "finite"}}
    result = compare(_exp({"q": "Int8Tensor"}), data, "library", "current", "python", None)
    assert result.outcome == "silently wrong" and result.silent
    assert result.detail == ("layer model.layers.0.self_attn.q_proj computes non-finite values (NaN); the output is "
                             "finite only because a later kernel on this machine drops them")


class _DropsNaN(__import__("torch").nn.Module):  # as the AVX-512 CPU attention kernel does with an all-NaN query
    def forward(self, x: Any) -> Any:
        return x.nan_to_num(0.0)


@pytest.mark.parametrize("fill", [float("nan"), float("inf")])
def test_the_worker_reports_a_nan_inside_a_finite_output_but_not_an_infinity(tmp_path: Path, fill: float) -> None:
    import torch
    from safetensors.torch import save_file

    from publisher import loadpath

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _DropsNaN(), torch.nn.Linear(4, 4))
    with torch.no_grad():
        model[0].weight[0, 0] = fill
    save_file({"x": torch.ones(1, 4)}, str(tmp_path / "in.safetensors"))
    found = loadpath.run_forward(_Wrapped(model), "transformers", str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors"))
    # An infinity may be clamped away by design (the output decides); a NaN never is
    assert found == ({"layer": "inner.0", "what": "NaN", "output": "finite"} if fill != fill else None)


def test_the_first_non_finite_layer_is_found_by_the_worker() -> None:
    import torch

    from publisher import loadpath

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    with torch.no_grad():
        for layer in (model[0], model[2]):
            layer.weight.fill_(1.0)
            layer.bias.zero_()
        model[2].weight[0, 0] = float("inf")  # inf * 4 + finite: inf, first in layer inner.2
    found = loadpath.first_nonfinite(_Wrapped(model), "transformers", {"x": torch.ones(1, 4)})
    assert found == {"layer": "inner.2", "what": "inf"}


class _Wrapped(__import__("torch").nn.Module):  # takes keyword inputs and returns a tuple, as the libraries' models do
    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Any) -> Any:
        return (self.inner(x),)


# ----------------------------------------------------------------------------- publish of a quantized base


def test_publish_refuses_a_quantized_transformers_model(cli: Any, corpus: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = cli(str(corpus["tf-int8wo"]), "--quant", "int8wo", "--no-push", "--output-dir", str(out))
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"Error: {corpus['tf-int8wo']} is already quantized: config.json has a quantization_config (torchao: "
        "Int8WeightOnlyConfig); hf-ao-publish quantizes an unquantized model, so publish from the unquantized base it "
        "was made from")
    assert "Traceback" not in result.output and not out.exists()


def test_publish_refuses_quantized_tensors_without_a_declared_config(cli: Any, corpus: dict[str, Path], tmp_path: Path) -> None:
    result = cli(str(corpus["tf-undeclared"]), "--quant", "int8wo", "--no-push", "--output-dir", str(tmp_path / "out"))
    assert result.exit_code == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"Error: {corpus['tf-undeclared']} is already quantized: model.safetensors holds torchao tensors (")
    assert last.endswith("publish from the unquantized base it was made from")


def test_publish_refuses_a_quantized_pipeline_before_any_download(cli: Any, hub: Any, corpus: dict[str, Path]) -> None:
    import os

    from huggingface_hub import HfApi

    folder = corpus["flux-pipeline"]
    (folder / "README.md").write_text("---\nbase_model: bfl/tiny-flux\nlibrary_name: diffusers\n---\n# peer\n")
    seed("bob/tiny-flux-int8wo-peer", folder, "tok_bob")
    result = cli("bob/tiny-flux-int8wo-peer", "--quant", "int8wo", "--repo-id", "alice/never-made", token="tok_alice")
    assert result.exit_code == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: bob/tiny-flux-int8wo-peer@") and "is already quantized: " in last
    assert "has a quantization_config (torchao" in last and last.endswith("(its card names base_model: bfl/tiny-flux)")
    assert not HfApi(token="tok_alice").repo_exists("alice/never-made")
    cache = Path(os.environ["HF_HOME"]) / "hub" / "models--bob--tiny-flux-int8wo-peer"
    assert not [p for p in cache.rglob("*") if p.suffix in (".safetensors", ".bin")]  # no weight was downloaded


# -------------------------------------------------------------------------------- the CLI, end to end


def _verify(cli: Any, *args: str, token: str | None = None) -> tuple[Any, dict[str, Any]]:
    result = cli("verify", *args, "--json", token=token)
    return result, json.loads(result.stdout)


@pytest.mark.slow
def test_a_standalone_diffusers_model_in_pickle_verifies(cli: Any, corpus: dict[str, Path]) -> None:
    result, data = _verify(cli, str(corpus["flux-model-bin"]), "--compat", "none")
    assert result.exit_code == 0, result.output
    assert [(r["component"], r["path"], r["outcome"]) for r in data["results"]] == [("", "library", "pass"), ("", "manual", "pass")]
    assert all(r["class_found"] == "Int8Tensor" and r["silent"] is False for r in data["results"])
    assert data["self_consistency_only"] is True and data["values"].startswith("only checked for self-consistency")
    assert {c["what"]: c["ok"] for c in data["content"]} == {"declared config": True, "stored values": True}
    assert "values only checked for self-consistency (no base compared)" in result.stderr


@pytest.mark.slow
def test_a_nan_scale_is_named_as_non_finite(cli: Any, corpus: dict[str, Path]) -> None:
    result, data = _verify(cli, str(corpus["tf-nan-scale"]), "--compat", "none")
    assert result.exit_code == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last == (f"Error: verification of {corpus['tf-nan-scale']} failed: model: the stored scale of {LLAMA_LAYER}.weight "
                    f"holds NaN (128 of 128 values): the layer {LLAMA_LAYER} computes non-finite outputs")
    assert "Traceback" not in result.output
    library = next(r for r in data["results"] if r["path"] == "library")
    assert library["outcome"] == "silently wrong" and library["silent"] is True
    # Whether the NaN reaches the logits is the CPU's attention kernel's doing (AVX-512's drops an all-NaN query,
    # AVX2's carries it on); the layer is named either way
    assert library["detail"] in (f"the output holds non-finite values (NaN), first produced by layer {LLAMA_LAYER}",
                                 f"layer {LLAMA_LAYER} computes non-finite values (NaN); the output is finite only "
                                 "because a later kernel on this machine drops them")


@pytest.mark.slow
def test_the_release_recipe_equals_its_base_on_every_load_path(cli: Any, corpus: dict[str, Path]) -> None:
    """Per-layer configs, float32, embeddings quantized: the re-quantized base is what every fresh-process load must
    give, bit for bit (each records its tensors after moving the model, as a user's .to() would)."""
    result, data = _verify(cli, str(corpus["tf-release"]), "--base", str(BASES["llama-untied"]), "--compat", "none")
    assert result.exit_code == 0, result.output
    assert [(r["path"], r["outcome"], r["class_found"]) for r in data["results"]] == [
        ("library", "pass", "IntxUnpackedToInt8Tensor"), ("manual", "pass", "IntxUnpackedToInt8Tensor")]
    assert all(r["forward_checked"] and r["max_abs_diff"] == 0.0 for r in data["results"])
    assert data["tensor_class"] == "IntxUnpackedToInt8Tensor" and data["self_consistency_only"] is False


@pytest.mark.slow
def test_a_hub_model_repo_is_compared_with_the_base_its_card_names(cli: Any, hub: Any, flux_repo: str,
                                                                  corpus: dict[str, Path]) -> None:
    """A standalone diffusers model repo whose card names the pipeline it came from: the base's transformer is
    re-quantized with the declared config, and every tensor is bit-identical."""
    folder = corpus["flux-model"]
    (folder / "README.md").write_text(f"---\nbase_model: {flux_repo}\nlibrary_name: diffusers\n---\n# peer\n")
    seed("bob/tiny-flux-transformer-int8wo", folder, "tok_bob")
    result, data = _verify(cli, "bob/tiny-flux-transformer-int8wo", "--compat", "none")
    assert result.exit_code == 0, result.output
    against = next(c for c in data["content"] if c["what"] == "against the base")
    assert against["ok"] and against["detail"].startswith("all ") and "bit-identical" in against["detail"]
    assert data["base"].startswith(f"{flux_repo}@") and data["self_consistency_only"] is False
    assert "values match the base" in result.stderr


def test_the_corpus_names_every_row_of_the_issue() -> None:
    assert set(PEERS) >= {"tf-int8wo", "tf-float8wo", "tf-int8dq", "tf-release", "tf-release-own-head", "flux-pipeline", "flux-model",
                          "flux-model-bin", "flux-pipeline-bin", "tf-float8-as-int8wo", "tf-nan-scale", "tf-zero-scale",
                          "tf-sign-flip"}
