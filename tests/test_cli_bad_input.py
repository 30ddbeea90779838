"""The bad-input catalogue: each case exits with the right code, one clear line, no traceback,
and creates or changes nothing on the Hub."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import SKIP_EVAL_AND_MATRIX, seed


@pytest.fixture(scope="module")
def special_repos(hub: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from publisher.testing.tiny import build_not_a_model, build_remote_code_model, build_tiny_llama

    root = tmp_path_factory.mktemp("special")
    seed("bfl/not-a-model", build_not_a_model(root / "nam"), "tok_bfl")
    seed("bfl/remote-code", build_remote_code_model(root / "rc"), "tok_bfl")
    seed("bfl/gated-llama", build_tiny_llama(root / "gl"), "tok_bfl")
    hub.set_gated("bfl/gated-llama", granted_users=())
    return {"not_a_model": "bfl/not-a-model", "remote": "bfl/remote-code", "gated": "bfl/gated-llama"}


def _repos_of(user_token: str) -> set[str]:
    from huggingface_hub import HfApi

    return {r for r in ("alice/tiny-llama-torchao-int8wo", "alice/x", "acme/x", "bob/x", "alice/tiny-flux-torchao-int8wo-bad")
            if HfApi(token=user_token).repo_exists(r)}


CASES = [
    # id, args, token, exit code, message fragment
    ("unknown recipe", ["{llama}", "--quant", "int3"], "tok_alice", 2, "unknown recipe 'int3'"),
    ("gpu recipe on cpu", ["{llama}", "--quant", "int4wo"], "tok_alice", 1,
     "int4wo needs a CUDA GPU with compute capability >= 8.0 to quantize, and this machine has none; add --on-hf-jobs "
     "FLAVOR to run it on Hugging Face Jobs (l4x1 or a10g-small; `hf-ao-publish recipes` lists the flavors), run it on "
     "such a GPU, or pick a CPU recipe (int8wo, "),
    ("recipe in capitals", ["{llama}", "--quant", "INT8WO"], "tok_alice", 2, "unknown recipe 'INT8WO' (did you mean int8wo?)"),
    ("recipe with a zero", ["{llama}", "--quant", "int8w0"], "tok_alice", 2, "unknown recipe 'int8w0' (did you mean int8wo?)"),
    ("recipe missing a letter", ["{llama}", "--quant", "in8wo"], "tok_alice", 2, "unknown recipe 'in8wo' (did you mean int8wo?)"),
    ("layer config file missing", ["{llama}", "--quant", "int8wo", "--layer-config", "no-such-layers.json"], "tok_alice", 2,
     f"--layer-config 'no-such-layers.json': no such file: {Path.cwd() / 'no-such-layers.json'}; --layer-config takes a "
     "JSON file, or a JSON object inline"),
    ("mistyped folder", ["./no-such-pipe", "--quant", "int8wo"], "tok_alice", 2,
     "no such folder: ./no-such-pipe; give an existing folder as MODEL_ID, or a Hub repo id (NAMESPACE/NAME)"),
    ("mistyped folder, no token", ["./no-such-pipe", "--quant", "int8wo"], None, 2, "no such folder: ./no-such-pipe"),
    ("mistyped verify target", ["verify", "./no-such-pipe", "--compat", "none"], None, 2,
     "no such folder: ./no-such-pipe; give an existing folder as TARGET, or a Hub repo id (NAMESPACE/NAME)"),
    ("mistyped command", ["verfy", "./no-such-pipe"], None, 2, "No such command 'verfy'. Did you mean 'verify'?"),
    ("malformed model id", ["not a repo//x", "--quant", "int8wo"], "tok_alice", 2, "neither an existing local folder nor a Hub repo id"),
    ("repo not found", ["bfl/missing-model", "--quant", "int8wo"], "tok_alice", 1, "bfl/missing-model not found"),
    ("gated without access", ["{gated}", "--quant", "int8wo"], "tok_alice", 1, "is gated"),
    ("revision not found", ["{llama}", "--quant", "int8wo", "--revision", "no-such-branch"], "tok_alice", 1, "revision 'no-such-branch' not found in meta/tiny-llama"),
    ("not a model repo", ["{not_a_model}", "--quant", "int8wo"], "tok_alice", 1, "neither a diffusers pipeline"),
    ("remote code", ["{remote}", "--quant", "int8wo"], "tok_alice", 1, "--trust-remote-code"),
    ("unknown component", ["{flux}", "--quant", "int8wo", "--components", "transformer,unet"], "tok_alice", 2, "has no component 'unet'; its model_index.json names: scheduler, text_encoder, text_encoder_2, tokenizer, tokenizer_2, transformer, vae"),
    ("component not a model", ["{flux}", "--quant", "int8wo", "--components", "scheduler"], "tok_alice", 2, "'scheduler' is not a model"),
    ("exclude not a module", ["{llama}", "--quant", "int8wo", "--exclude", "model.layers.9.mlp"], "tok_alice", 2, "--exclude 'model.layers.9.mlp' matches no module"),
    ("no token when pushing", ["{llama}", "--quant", "int8wo"], None, 1, "pushing needs a Hub token"),
    ("invalid token", ["{llama}", "--quant", "int8wo"], "tok_wrong", 1, "rejected the token"),
    ("namespace not writable", ["{llama}", "--quant", "int8wo", "--repo-id", "bob/x"], "tok_alice", 1, "cannot write to the namespace 'bob'"),
    ("target id malformed", ["{llama}", "--quant", "int8wo", "--repo-id", "no-namespace"], "tok_alice", 2, "--repo-id 'no-namespace' is not a valid Hub repo id"),
    ("components on a transformers model", ["{llama}", "--quant", "int8wo", "--components", "model"], "tok_alice", 2, "applies to diffusers pipelines"),
    ("verify-env not an interpreter", ["{llama}", "--quant", "int8wo", "--verify-env", "/no/such/python"], "tok_alice", 2,
     "--verify-env '/no/such/python' is neither a Python interpreter (no executable file there) nor a version spec"),
    ("verify-env spec names a package twice", ["{llama}", "--quant", "int8wo", "--verify-env", "transformers==5.0.0,transformers==5.1.0"],
     "tok_alice", 2, "transformers is named twice"),
    # the one case that gets as far as the defaults: the evaluation's text is read before the environment is built
    ("verify-env spec cannot be built", ["{llama}", "--quant", "int8wo", "--verify-env", "transformers==999.0.0", *SKIP_EVAL_AND_MATRIX],
     "tok_alice", 1,
     "cannot build the verification environment transformers==999.0.0: pip install failed: "
     "No matching distribution found for transformers==999.0.0; check the spec and access to the package index (PyPI)"),
    ("compat none with more", ["{llama}", "--quant", "int8wo", "--compat", "none", "--compat", "transformers==5.0.0"], "tok_alice", 2,
     "--compat none cannot be combined with other --compat values"),
    ("compat not an environment", ["{llama}", "--quant", "int8wo", "--compat", "transformers"], "tok_alice", 2,
     "--compat 'transformers' is not an environment; give default, latest, none, or a spec like torch==2.15.0 or diffusers==0.39.0"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(cli: Any, flux_repo: str, llama_repo: str, special_repos: dict[str, str], case: tuple[Any, ...]) -> None:
    _, args, token, code, fragment = case
    names = {"flux": flux_repo, "llama": llama_repo, **special_repos}
    args = [a.format(**names) for a in args]
    before = _repos_of("tok_alice")
    result = cli(*args, token=token)
    assert result.exit_code == code, result.output
    assert fragment in result.stderr, result.stderr
    assert "Traceback" not in result.output
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(error_lines) == 1
    assert _repos_of("tok_alice") == before
    assert "tok_alice" not in result.output


def test_output_dir_not_empty(cli: Any, llama_repo: str, tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    result = cli(llama_repo, "--quant", "int8wo", "--no-push", "--output-dir", str(tmp_path))
    assert result.exit_code == 1
    assert "is not empty" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_output_dir_not_writable(cli: Any, llama_repo: str, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    result = cli(llama_repo, "--quant", "int8wo", "--no-push", "--output-dir", str(blocker / "sub"))
    assert result.exit_code == 1
    assert "is not writable" in result.stderr


def test_disk_too_small(cli: Any, llama_repo: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    out = tmp_path / "out"
    result = cli(llama_repo, "--quant", "int8wo", "--no-push", "--output-dir", str(out))
    assert result.exit_code == 1
    assert "not enough disk" in result.stderr and "GB free" in result.stderr
    assert not out.exists()


def test_endpoint_unreachable(tmp_path: Path) -> None:
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_TOKEN": "tok_alice", "HF_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "publisher.cli", "org/model", "--quant", "int8wo"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "cannot reach the Hub at http://127.0.0.1:9" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_debug_shows_traceback(cli: Any, hub: Any) -> None:
    from huggingface_hub.errors import RepositoryNotFoundError

    with pytest.raises(RepositoryNotFoundError):
        cli("bfl/missing-model", "--quant", "int8wo", "--no-push", "--debug")


def test_a_misspelt_component_fails_as_soon_as_model_index_is_read(tiny_flux_dir: Path) -> None:
    """Before the libraries are imported (they tell models from tokenizers, and take seconds to import): the names
    come from model_index.json alone."""
    code = ("import sys\nfrom publisher.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as exc:\n    print('exit', exc.code)\n"
            "print(sorted(m for m in ('torch', 'torchao', 'diffusers', 'transformers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code, str(tiny_flux_dir), "--quant", "int8wo", "--components", "transfomer",
                           "--no-push"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.stdout.splitlines() == ["exit 2", "[]"], proc.stderr
    error = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert error == [f"Error: --components: {tiny_flux_dir} has no component 'transfomer' (did you mean 'transformer'?); "
                     "its model_index.json names: scheduler, text_encoder, text_encoder_2, tokenizer, tokenizer_2, "
                     "transformer, vae"], proc.stderr
