"""Test isolation: a loopback Hub for the whole session, a private HF_HOME, no real token.

huggingface_hub reads HF_ENDPOINT, HF_HOME and HF_HUB_DISABLE_XET when it is imported, so they are
set here, at conftest import, before any test module imports it. The server is the project's own
(publisher.testing.hubserver); the client is the real, unmodified huggingface_hub.

Transfers run as users have them: through Xet (huggingface_hub's default; the loopback Hub serves it), with
``resolve/`` redirecting LFS files to a second origin, and LFS objects above MULTIPART_THRESHOLD uploaded in
parts when Xet is off. ``HF_AO_TEST_TRANSFER=lfs`` runs a session with ``HF_HUB_DISABLE_XET=1`` (plain LFS and
HTTP): ``make test`` runs the tests marked ``transfer`` that way too, so each of them passes in both modes.
"""

from __future__ import annotations

import gc
import hashlib
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import scheduling


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_SESSION_DIR = Path(tempfile.mkdtemp(prefix="hf-ao-publish-tests-"))
HUB_PORT = _free_port()
HUB_URL = f"http://127.0.0.1:{HUB_PORT}"
for _var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "HF_TOKEN_PATH", "HF_HUB_CACHE", "TRANSFORMERS_CACHE"):
    os.environ.pop(_var, None)
os.environ["HF_ENDPOINT"] = HUB_URL
MULTIPART_THRESHOLD = 1 << 20  # the tiny FLUX transformer (2.1 MB) goes up in parts; its text encoders in one PUT
os.environ["HF_HOME"] = str(_SESSION_DIR / "hf_home")
# torch.hub's folder, where LPIPS looks for torchvision's AlexNet: empty unless a test places a trunk there, so that a
# developer's own download does not decide what the tests see
os.environ["TORCH_HOME"] = str(_SESSION_DIR / "torch_home")
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
# torch's CPU kernels run on OpenMP threads (one per core), and libgomp's idle threads spin before they sleep (about
# 300,000 turns after each parallel region). The suite runs two workers, each with its load paths, snippets and CLI
# processes, on as many cores: a spinning thread takes the core another process needs, and tiny models make a parallel
# region of almost every op. PASSIVE makes an idle thread sleep at once; the thread count, and so what each op
# computes, stays as users have it. The family corpus on 2 cores, one run after the other: 78 s (148 s of CPU)
# without it, 42 s (82 s of CPU) with it. Set before torch is imported anywhere (TORCH_BEFORE_CONFTEST, checked by
# tests/test_makefile.py), so the workers' own OpenMP reads it too; every process the tests start inherits it.
TORCH_BEFORE_CONFTEST = "torch" in sys.modules
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# What the test files share (tests/helpers.py): it imports neither huggingface_hub nor torch, so the variables they
# read when imported (HF_HUB_DISABLE_XET below) may still be set after it
from helpers import DEFAULTS_VARIABLES, FAST_TRIES, PROGRESS_VARS, TRANSFER, seed  # noqa: E402

if TRANSFER == "lfs":  # HF_AO_TEST_TRANSFER (helpers.TRANSFER): Xet off, plain LFS and HTTP
    os.environ["HF_HUB_DISABLE_XET"] = "1"
else:
    os.environ.pop("HF_HUB_DISABLE_XET", None)
# The product's defaults run whatever the shell sets: a test that wants the matrix or the evaluation off says so on
# its own command line (helpers.SKIP_EVAL_AND_MATRIX); tests/test_makefile.py checks that no fixture sets them.
for _var in DEFAULTS_VARIABLES:
    os.environ.pop(_var, None)
# Environments built for --verify-env and the compatibility matrix are kept across test sessions (keyed by spec and by
# this environment), outside the throw-away HF_HOME.
os.environ.setdefault("HF_AO_PUBLISH_ENVS", str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                                                 / "hf-ao-publish-tests" / "envs"))
# What the matrix's loads found is kept for a later run with the same files in the same environment (verify/memo.py):
# a test session starts with none, so the first publish of each repo measures for real; the LFS pass of `make test`
# (the second session) reads what the Xet pass measured, as a user's re-run would. One folder per checkout: a session
# in another checkout on the same machine (a second worktree) starts by emptying its own, never this one's.
_CHECKOUT = hashlib.sha256(str(Path(__file__).resolve().parent.parent).encode()).hexdigest()[:12]
MEASURED = Path(os.environ["HF_AO_PUBLISH_ENVS"]).parent / "measured" / _CHECKOUT
os.environ["HF_AO_PUBLISH_MEASURED"] = str(MEASURED)
if TRANSFER == "xet" and not os.environ.get("PYTEST_XDIST_WORKER"):  # once, in the controller, before any worker
    shutil.rmtree(MEASURED, ignore_errors=True)


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch, hub: Any) -> Any:
    """Retries made fast (FAST_TRIES tries, 50 ms apart), and no loopback-Hub fault before or after the test."""
    monkeypatch.setenv("HF_AO_PUBLISH_RETRIES", str(FAST_TRIES))
    monkeypatch.setenv("HF_AO_PUBLISH_RETRY_DELAY", "0.05")
    hub.clear_faults()
    yield
    hub.clear_faults()


TOKENS = {"tok_alice": "alice", "tok_bob": "bob", "tok_bfl": "bfl", "tok_meta": "meta", "tok_sf": "Salesforce",
          "tok_docs": "docs"}  # docs: the user the docs commands publish as (tests/test_docs_commands.py)
ORGS = {"acme": ["alice"], "my-org": ["alice"]}  # my-org: the target of a docs/action.md example


@pytest.fixture(scope="session")
def hub() -> Any:
    from publisher.testing.hubserver import HubServer

    server = HubServer(_SESSION_DIR / "hub-data", tokens=TOKENS, orgs=ORGS, port=HUB_PORT,
                       multipart_threshold=MULTIPART_THRESHOLD, multipart_chunk=MULTIPART_THRESHOLD // 2)
    server.start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test sees a token unless it sets one."""
    monkeypatch.delenv("HF_TOKEN", raising=False)


@pytest.fixture(autouse=True)
def _progress_vars_restored() -> Any:
    saved = {name: os.environ.get(name) for name in PROGRESS_VARS}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def _zygotes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Load-path workers forked from a zygote, as on every Linux run, unless a test switches it off: the zygote tests
    and the worker-tree checks assert the forked path, whatever HF_AO_PUBLISH_ZYGOTE the shell has."""
    monkeypatch.delenv("HF_AO_PUBLISH_ZYGOTE", raising=False)


@pytest.fixture(autouse=True)
def _own_resume_cache(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Each test its own resume cache (finished components, stages/unfinished.py): what another test left there (an
    interrupted run, say) must not stand in for a quantization this test needs to happen, whatever order the tests
    run in. A test's own re-runs share it, as a user's do."""
    monkeypatch.setenv("HF_AO_PUBLISH_CACHE", str(tmp_path_factory.mktemp("components")))


@pytest.fixture(scope="session")
def tiny_flux_dir() -> Path:
    from publisher.testing.tiny import build_tiny_flux

    return build_tiny_flux(_SESSION_DIR / "models" / "tiny-flux")


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    from publisher.testing.tiny import build_tiny_llama

    return build_tiny_llama(_SESSION_DIR / "models" / "tiny-llama")


@pytest.fixture(scope="session")
def flux_repo(hub: Any, tiny_flux_dir: Path) -> str:
    seed("bfl/tiny-flux", tiny_flux_dir, "tok_bfl")
    return "bfl/tiny-flux"


@pytest.fixture(scope="session")
def llama_repo(hub: Any, tiny_llama_dir: Path) -> str:
    seed("meta/tiny-llama", tiny_llama_dir, "tok_meta")
    return "meta/tiny-llama"


@pytest.fixture(scope="session")
def wikitext_repo(hub: Any) -> str:
    """The default --eval-dataset (Salesforce/wikitext, wikitext-2-raw-v1, test) as a small parquet dataset repo."""
    from huggingface_hub import HfApi

    from publisher.testing.evaldata import DATASET_REPO, build_text_dataset

    folder = build_text_dataset(_SESSION_DIR / "datasets" / "wikitext")
    api = HfApi(token="tok_sf")
    api.create_repo(DATASET_REPO, repo_type="dataset", exist_ok=True)
    api.upload_folder(repo_id=DATASET_REPO, repo_type="dataset", folder_path=folder, commit_message="seed")
    return DATASET_REPO


@pytest.fixture(scope="session")
def trained_llama_repo(hub: Any) -> str:
    """A tiny Llama trained on the fixture dataset's sentences (publisher.testing.evaldata), as meta/trained-llama."""
    from publisher.testing.evaldata import build_trained_llama

    seed("meta/trained-llama", build_trained_llama(_SESSION_DIR / "models" / "trained-llama"), "tok_meta")
    return "meta/trained-llama"


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Run the real CLI in-process: cli(*args, token=...) -> click Result."""
    from click.testing import CliRunner

    from publisher.cli import main

    def invoke(*args: str, token: str | None = None) -> Any:
        if token:
            monkeypatch.setenv("HF_TOKEN", token)
        else:
            monkeypatch.delenv("HF_TOKEN", raising=False)
        return CliRunner().invoke(main, list(args), catch_exceptions=False)

    return invoke


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    shutil.rmtree(_SESSION_DIR, ignore_errors=True)


# ---------------------------------------------------------------- the cyclic GC of a worker
# A worker holds the objects of torch, torchao, diffusers, transformers and every pipeline module a test imported
# (millions), and each full collection walks them all again. After each test (and the collection) its garbage is
# collected and what is left frozen out of later collections (gc.freeze): about a quarter of the CPU time the tests
# spend in the worker's own process (measured on the families, the streaming tests and the one-pass tests: 69.7 s ->
# 60.6 s). Garbage is still collected; what is alive after a test's teardown (session and module fixtures, modules)
# is no longer walked, and should some of it become garbage in a reference cycle later it stays (tiny models: small).
def pytest_collection_finish(session: Any) -> None:
    gc.collect()
    gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: Any, nextitem: Any) -> None:
    gc.collect()
    gc.freeze()


# ---------------------------------------------------------------- how the suite spreads over the workers
# `make test` runs `--dist loadscope` with the scheduler of tests/scheduling.py: a test file stays on one worker, the
# files that share no module fixture are spread test by test, the costliest files first.
@pytest.hookimpl(optionalhook=True)  # xdist's hook: absent with -p no:xdist
def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
    return scheduling.make_scheduler(config, log)


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    scheduling.order(items)
