"""End to end: the real CLI publishes tiny models to the loopback Hub; plain from_pretrained loads them back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import IN_PROCESS, PROGRESS_VARS, SKIP_EVAL_AND_MATRIX, XET_DEFAULT_VERIFY, progress_bars

from publisher import recipes

SMALL = ["--sample-steps", "2", "--sample-size", "64"]


def _torchao_classes(model: Any) -> set[str]:
    import torch
    from torchao.utils import TorchAOBaseTensor

    return {type(m.weight).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear) and isinstance(m.weight, TorchAOBaseTensor)}


@pytest.mark.slow
@pytest.mark.transfer
def test_publish_flux_pipeline_and_load_it_back(cli: Any, flux_repo: str) -> None:
    import torch
    from diffusers import DiffusionPipeline
    from huggingface_hub import HfApi, model_info

    result = cli(flux_repo, "--quant", "int8wo", "--json", *SMALL, *SKIP_EVAL_AND_MATRIX, token="tok_alice")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["repo_id"] == "alice/tiny-flux-torchao-int8wo"
    assert data["verified"] is True and data["recipe"] == "int8wo"
    assert data["url"].endswith("/alice/tiny-flux-torchao-int8wo")
    assert len(data["commit"]) == 40
    assert [c["name"] for c in data["components"]] == ["transformer"]
    names = {f["name"] for f in data["files"]}
    assert "flux1-tiny.safetensors" not in names  # root single-file checkpoint never copied
    assert {"README.md", "model_index.json", "transformer/diffusion_pytorch_model.safetensors", "LICENSE.md"} <= names
    assert not any(n.endswith(".bin") for n in names)
    assert "tok_alice" not in result.output

    base_sha = model_info(flux_repo).sha
    commits = HfApi().list_repo_commits("alice/tiny-flux-torchao-int8wo")
    assert flux_repo in commits[0].title and base_sha[:12] in commits[0].title and "int8wo" in commits[0].title
    # the single-file checkpoint was never downloaded either
    hf_home = Path(__import__("os").environ["HF_HOME"])
    assert not list(hf_home.rglob("flux1-tiny.safetensors"))

    pipe = DiffusionPipeline.from_pretrained("alice/tiny-flux-torchao-int8wo", torch_dtype=torch.bfloat16)
    assert _torchao_classes(pipe.transformer) == {"Int8Tensor"}
    assert _torchao_classes(pipe.text_encoder_2) == set()
    image = pipe("a cat", num_inference_steps=2, height=64, width=64, generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (64, 64)


# What a successful run may print besides our own lines: nothing from the libraries. These marks catch the
# third-party lines seen on the Hub's transfer paths (huggingface_hub's Xet fallback, hf_xet); progress bars are
# helpers.progress_bars'.
THIRD_PARTY = ("Xet Storage", "Falling back", "hf_xet", "huggingface_hub", "Warning", "warning:", "deprecated",
               "Failed to load", "Unable to import", "Traceback")


@pytest.mark.slow
@pytest.mark.transfer
def test_a_publish_through_the_hub_prints_only_our_own_lines(hub: Any, flux_repo: str, tmp_path: Path) -> None:
    """The real CLI in a fresh process (so hf_xet's own output would show), its stderr a pipe as in a CI log:
    downloads, a --low-disk push with files copied Hub to Hub, a plain push, and a plain push with --quiet, in this
    session's transfer mode. stderr holds our lines only, one per stage or file, and no progress bar (huggingface_hub's,
    hf_xet's, transformers', ours); with --quiet, nothing but the URL on stdout. (The default verification's reloads,
    in the Xet session: they read the local folder whatever the transfer mode.)"""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_TOKEN": "tok_alice", "HF_HOME": str(tmp_path / "home"), "TMPDIR": str(tmp_path)}
    for name in PROGRESS_VARS:  # as a user runs it: the suite's own HF_HUB_DISABLE_PROGRESS_BARS=1 would hide the bars
        env.pop(name, None)
    runs = ((["--low-disk"], "alice/quiet-low-disk", XET_DEFAULT_VERIFY), ([], "alice/quiet-plain", XET_DEFAULT_VERIFY),
            (["--quiet"], "alice/quiet-quiet", IN_PROCESS))  # --quiet's subject is the output: verified in process
    said: dict[str, list[str]] = {}
    for extra, target, verify in runs:
        proc = subprocess.run([sys.executable, "-m", "publisher.cli", flux_repo, "--quant", "int8wo", "--repo-id", target,
                               *extra, *SMALL, *SKIP_EVAL_AND_MATRIX, *verify], env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert not progress_bars(proc.stderr), progress_bars(proc.stderr)[:5]
        lines = said[target] = [line for line in proc.stderr.splitlines() if line.strip()]
        noisy = [line for line in lines if any(mark in line for mark in THIRD_PARTY)]
        assert not noisy, noisy
        assert proc.stdout == f"{hub.url}/{target}\n"
        if "--quiet" in extra:
            assert proc.stderr == ""
        else:
            assert lines[-1].startswith(f"published {target}: "), lines
            assert any(line.startswith("quantizing transformer (FluxTransformer2DModel) with int8wo") for line in lines)
    # the plain push's stage line, where the upload bars were
    assert any(line.startswith("uploading ") and line.endswith(" to alice/quiet-plain, then committing them")
               for line in said["alice/quiet-plain"])


@pytest.mark.slow
def test_publish_llama_and_generate(cli: Any, llama_repo: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # the subject is the push to an organisation and plain from_pretrained + generate; the fresh-process reloads of a
    # Llama are tests/test_families.py's and test_verify_full.py's
    result = cli(llama_repo, "--quant", "int8wo", "--repo-id", "acme/llama-int8", "--json", *IN_PROCESS, *SKIP_EVAL_AND_MATRIX,
                 token="tok_alice")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["repo_id"] == "acme/llama-int8" and data["verified"]
    comp = data["components"][0]
    assert comp["name"] == "model" and comp["quantized_layers"] == 14  # 15 Linear, lm_head kept by transformers
    model = AutoModelForCausalLM.from_pretrained("acme/llama-int8", dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained("acme/llama-int8")
    assert _torchao_classes(model) == {"Int8Tensor"}
    out = model.generate(**tok("hello world", return_tensors="pt"), max_new_tokens=4, do_sample=False)
    assert out.shape[1] > 2


# The CPU recipes on each load path, the transformers-saved text encoder and the folder as a standalone repo:
# tests/test_verify_full.py::test_all_paths_text_encoder_and_llama (one publish per recipe for both checks).


def test_gpu_recipe_fails_before_any_download(cli: Any, hub: Any) -> None:
    result = cli("nobody/does-not-exist", "--quant", "int4wo", "--no-push")
    assert result.exit_code == 1
    assert "int4wo needs a CUDA GPU" in result.stderr
    assert "Traceback" not in result.output


def test_recipes_command_lists_the_registry(cli: Any) -> None:
    result = cli("recipes")
    assert result.exit_code == 0
    for r in recipes.all_recipes():
        assert r.name in result.stdout
    assert "compute capability >= 8.9" in result.stdout
    result = cli("recipes", "--json")
    assert [r["name"] for r in json.loads(result.stdout)] == recipes.names()


@pytest.mark.slow
def test_streaming_and_library_engines_publish_the_same_tensors(cli: Any, tiny_llama_dir: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    outs = {}
    for engine in ("streaming", "library"):
        out = tmp_path / engine
        result = cli(str(tiny_llama_dir), "--quant", "int8wo", "--engine", engine, "--no-push", "--output-dir", str(out), "--json",
                     *IN_PROCESS, *SKIP_EVAL_AND_MATRIX)
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        assert data["components"][0]["engine"] == engine
        assert set(data["seconds"]) >= {"download", "quantize", "verify"}
        assert data["peak_rss_bytes"]["process"] > 0
        outs[engine] = out
    script = Path(__file__).resolve().parents[1] / "scripts" / "compare_checkpoints.py"
    proc = subprocess.run([sys.executable, str(script), str(outs["streaming"]), str(outs["library"])], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
    assert " 0 differences" in proc.stdout


@pytest.mark.slow
def test_benchmark_section_on_cpu(cli: Any, tiny_flux_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = cli(str(tiny_flux_dir), "--quant", "int8wo", "--benchmark", "--no-push", "--output-dir", str(out), "--json", *SMALL,
                 *IN_PROCESS, *SKIP_EVAL_AND_MATRIX)
    assert result.exit_code == 0, result.output
    bench = json.loads(result.stdout)["benchmark"]
    assert bench["device"] == "cpu" and bench["rows"][0]["component"] == "transformer"
    for kind in ("bf16", "quantized"):
        assert bench["rows"][0][kind]["eager_ms"] > 0 and bench["rows"][0][kind]["compiled_ms"] is None
    card = (out / "README.md").read_text()
    assert "### Measured on the CPU" in card
    assert "|---|---|---|---|---|---|\n| transformer | bf16 | n/a | n/a |" in card


@pytest.mark.slow
def test_a_card_option_or_force_makes_a_new_commit(cli: Any, llama_repo: str) -> None:
    """A re-run that changes only the card (here its prompt) publishes the new card; --force publishes again what the
    target's state calls up to date (a card edited on the Hub is restored)."""
    from huggingface_hub import HfApi

    api, repo = HfApi(token="tok_alice"), "alice/refresh-card"
    args = [llama_repo, "--quant", "int8wo", "--repo-id", repo, "--json", *SMALL, *IN_PROCESS, *SKIP_EVAL_AND_MATRIX]
    assert cli(*args, token="tok_alice").exit_code == 0
    same = cli(*args, token="tok_alice")
    assert same.exit_code == 0 and json.loads(same.stdout)["up_to_date"]
    assert same.stderr.count("up to date") == 1 and "--force publishes it again" in same.stderr  # said once
    commits = len(api.list_repo_commits(repo))

    prompt = cli(*args, "--sample-prompt", "Once upon a time", token="tok_alice")
    assert prompt.exit_code == 0 and json.loads(prompt.stdout)["pushed"]
    assert len(api.list_repo_commits(repo)) == commits + 1
    assert "card" in api.list_repo_commits(repo)[0].message  # the description names what changed
    card = Path(api.hf_hub_download(repo, "README.md")).read_text()
    assert 'tokenizer("Once upon a time"' in card

    api.upload_file(path_or_fileobj=b"# edited by hand\n", path_in_repo="README.md", repo_id=repo, commit_message="edit")
    kept = cli(*args, "--sample-prompt", "Once upon a time", token="tok_alice")
    assert json.loads(kept.stdout)["up_to_date"]  # the state file still matches: the edit stays
    forced = cli(*args, "--sample-prompt", "Once upon a time", "--force", token="tok_alice")
    assert forced.exit_code == 0, forced.output
    data = json.loads(forced.stdout)
    assert data["pushed"] and not data["up_to_date"] and len(api.list_repo_commits(repo)) == commits + 3
    assert "with --force" in api.list_repo_commits(repo)[0].message
    assert Path(api.hf_hub_download(repo, "README.md", revision=data["commit"])).read_text() == card
