"""Verification: every load path, every CPU recipe, tampering, broken folders, other environments."""

from __future__ import annotations

import json
import shutil
import subprocess
import sysconfig
import venv
from pathlib import Path
from typing import Any

import pytest
from helpers import SKIP_EVAL_AND_MATRIX

from publisher import recipes

CPU_RECIPES = [r.name for r in recipes.all_recipes() if not r.needs_gpu_to_quantize and not r.run.cuda]  # made and run on a CPU
SMALL = ["--sample-steps", "2", "--sample-size", "64"]


def _publish_local(cli: Any, base: Path, out: Path, *extra: str) -> dict[str, Any]:
    result = cli(str(base), "--no-push", "--output-dir", str(out), "--json", *SMALL, *extra)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# int8wo on every load path of the tiny FLUX and Llama (and of every other family) is tests/test_families.py's corpus,
# with the same checks; here the other CPU recipes, one publish each.
@pytest.mark.slow
@pytest.mark.parametrize("recipe", [r for r in CPU_RECIPES if r != "int8wo"])
def test_all_paths_text_encoder_and_llama(cli: Any, tiny_flux_dir: Path, tiny_llama_dir: Path, tmp_path: Path, recipe: str) -> None:
    """Each CPU recipe on a pipeline (a diffusers and a transformers component) and on a causal LM: every load path
    reproduces the in-memory model bit for bit, and the folder is a standalone repo."""
    tensor_class = recipes.get(recipe).tensor_class
    flux = _publish_local(cli, tiny_flux_dir, tmp_path / "flux", "--quant", recipe, "--components", "transformer,text_encoder_2",
                          *SKIP_EVAL_AND_MATRIX)
    llama = _publish_local(cli, tiny_llama_dir, tmp_path / "llama", "--quant", recipe, *SKIP_EVAL_AND_MATRIX)
    out = tmp_path / "flux"
    assert flux["verified"] and flux["url"] is None and flux["commit"] is None  # --no-push: nothing on the Hub
    assert json.loads((out / "verification.json").read_text())["passed"]
    assert (out / "README.md").is_file() and (out / "model_index.json").is_file()
    by_name = {c["name"]: c for c in flux["components"]}
    assert set(by_name) == {"transformer", "text_encoder_2"}
    assert all(tensor_class in c["tensor_classes"] for c in flux["components"])
    # the text encoder is saved by transformers, with transformers' torchao quantization_config
    assert json.loads((out / "text_encoder_2" / "config.json").read_text())["quantization_config"]["quant_method"] == "torchao"
    assert by_name["text_encoder_2"]["quantized_layers"] == 7
    for data, comps in ((flux, {"transformer", "text_encoder_2"}), (llama, {""})):
        report = data["verification"]
        assert report["passed"]
        seen = {(r["component"], r["path"]) for r in report["results"]}
        assert seen == {(c, p) for c in comps for p in ("library", "manual")}
        for r in report["results"]:
            assert r["ok"] and r["forward_checked"] and r["max_abs_diff"] == 0.0
            assert r["quantized_layers"] == report["expected_layers"][r["component"] or "model"] > 0
        assert report["tensor_class"] == tensor_class
        # 4-bit weights of these tiny random models: relative error 0.10-0.18, cosine 0.983-0.995 measured (int8: 0.01)
        four_bit = "torch.int4" in recipes.get(recipe).expression
        bound, cosine = (0.3, 0.97) if four_bit else (0.1, 0.99)
        assert all(0 <= q["rel_error"] < bound and q["cosine"] > cosine for q in data["quality"]), data["quality"]


@pytest.fixture(scope="module")
def verified_folder(tiny_flux_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from click.testing import CliRunner

    from publisher.cli import main

    out = tmp_path_factory.mktemp("verified") / "out"
    result = CliRunner().invoke(main, [str(tiny_flux_dir), "--quant", "int8wo", "--no-push", "--output-dir", str(out), *SMALL,
                                      *SKIP_EVAL_AND_MATRIX], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out


def _copy(folder: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(folder, dst)
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["forked", "fresh"])  # HF_AO_PUBLISH_ZYGOTE=0: what every system but Linux runs
def test_verify_command_passes_and_requantizes_the_base(cli: Any, verified_folder: Path, tiny_flux_dir: Path,
                                                        workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if workers == "fresh":
        monkeypatch.setenv("HF_AO_PUBLISH_ZYGOTE", "0")
    monkeypatch.chdir(tiny_flux_dir.parent)  # the state file names the local base by its folder's name: found here
    result = cli("verify", str(verified_folder), "--json", "--compat", "none")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] and report["recipe"] == "int8wo"
    assert "re-quantizing transformer" in result.stderr


@pytest.mark.slow
def test_tampered_tensor_fails_with_its_name(cli: Any, verified_folder: Path, tiny_flux_dir: Path, tmp_path: Path) -> None:
    import struct

    folder = _copy(verified_folder, tmp_path)
    shard = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    raw = bytearray(shard.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    key = "transformer_blocks.0.ff.net.2._weight_qdata"
    raw[8 + n + header[key]["data_offsets"][0]] ^= 0x01
    shard.write_bytes(bytes(raw))
    result = cli("verify", str(folder), "--base", str(tiny_flux_dir), "--compat", "none")
    assert result.exit_code == 1
    assert "tensor transformer_blocks.0.ff.net.2.weight differs from the base re-quantized with int8wo" in result.stderr


@pytest.mark.slow
def test_missing_shard_fails_every_path(cli: Any, verified_folder: Path, tmp_path: Path) -> None:
    folder = _copy(verified_folder, tmp_path)
    (folder / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    result = cli("verify", str(folder), "--no-requantize", "--json", "--compat", "none")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert not report["passed"] and report["results"] and not any(r["ok"] for r in report["results"])


@pytest.mark.slow
def test_failed_path_means_nothing_is_pushed(cli: Any, flux_repo: str, tmp_path: Path) -> None:
    from huggingface_hub import HfApi

    broken = tmp_path / "broken-python"
    broken.write_text("#!/bin/sh\necho 'ImportError: no torchao here' >&2\nexit 1\n")
    broken.chmod(0o755)
    result = cli(flux_repo, "--quant", "int8wo", "--repo-id", "alice/never-pushed", "--verify-env", str(broken), *SMALL,
                 *SKIP_EVAL_AND_MATRIX, token="tok_alice")
    assert result.exit_code == 1
    assert "verification of int8wo failed" in result.stderr and "nothing was pushed" in result.stderr
    assert "no torchao here" in result.stderr
    assert not HfApi(token="tok_alice").repo_exists("alice/never-pushed")


@pytest.fixture(scope="module")
def second_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second venv sharing the pinned torch stack, with another diffusers release when the index has it."""
    root = tmp_path_factory.mktemp("venv2")
    venv.create(root, with_pip=True)
    python = root / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # Share this environment's packages; anything installed into the new venv shadows them.
    Path(site, "shared-stack.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "diffusers==0.41.0"], capture_output=True, timeout=300)
    return python


@pytest.mark.slow
def test_verify_env_records_the_other_environment(cli: Any, tiny_flux_dir: Path, tmp_path: Path, second_env: Path) -> None:
    data = _publish_local(cli, tiny_flux_dir, tmp_path / "out", "--quant", "int8wo", "--verify-env", str(second_env),
                          *SKIP_EVAL_AND_MATRIX)
    results = data["verification"]["results"]
    other = [r for r in results if r["env"] == str(second_env)]
    assert {r["path"] for r in other} == {"library", "manual"} and all(r["ok"] for r in other)
    current = next(r for r in results if r["env"] == "current")
    assert other[0]["versions"]["python"] and other[0]["versions"]["torch"] == current["versions"]["torch"]
    card = (tmp_path / "out" / "README.md").read_text()
    assert str(second_env) in card and f"diffusers {other[0]['versions']['diffusers']}" in card
