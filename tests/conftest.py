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
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest


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
TRANSFER = os.environ.get("HF_AO_TEST_TRANSFER", "xet")
if TRANSFER not in ("xet", "lfs"):
    raise RuntimeError(f"HF_AO_TEST_TRANSFER must be xet or lfs, not {TRANSFER!r}")
if TRANSFER == "lfs":
    os.environ["HF_HUB_DISABLE_XET"] = "1"
else:
    os.environ.pop("HF_HUB_DISABLE_XET", None)
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
from publisher import compat  # noqa: E402  (no torch: the variables' names, as the CLI reads them)
from publisher.quality import options as quality_options  # noqa: E402

DEFAULTS_VARIABLES = (compat.VARIABLE, quality_options.BUDGET_VARIABLE)  # --compat and --eval-budget from the environment
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The product's defaults run whatever the shell sets: a test that wants the matrix or the evaluation off says so on
# its own command line (SKIP_EVAL_AND_MATRIX below); tests/test_makefile.py checks that no fixture sets them.
for _var in DEFAULTS_VARIABLES:
    os.environ.pop(_var, None)
# Environments built for --verify-env and the compatibility matrix are kept across test sessions (keyed by spec and by
# this environment), outside the throw-away HF_HOME.
os.environ.setdefault("HF_AO_PUBLISH_ENVS", str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                                                 / "hf-ao-publish-tests" / "envs"))
# What the matrix's loads found is kept for a later run with the same files in the same environment (verify/memo.py):
# a test session starts with none, so the first publish of each repo measures for real; the LFS pass of `make test`
# (the second session) reads what the Xet pass measured, as a user's re-run would.
MEASURED = Path(os.environ["HF_AO_PUBLISH_ENVS"]).parent / "measured"
os.environ["HF_AO_PUBLISH_MEASURED"] = str(MEASURED)
if TRANSFER == "xet" and not os.environ.get("PYTEST_XDIST_WORKER"):  # once, in the controller, before any worker
    shutil.rmtree(MEASURED, ignore_errors=True)

FAST_TRIES = 3  # HF_AO_PUBLISH_RETRIES under the fast_retries fixture
# For publishes whose subject is not the load paths (pushes, re-runs, Hub faults, integrity, resume, signals, quality
# figures, configs, repo ids): verification in process (every saved tensor against the in-memory one, a block-by-block
# forward) instead of the default's reloads in fresh interpreters, at about half the cost. The default stays where the
# load paths are the subject (docs/development.md, "The tiers").
IN_PROCESS = ["--verify-mode", "streaming"]
# The product's defaults (the compatibility matrix: a few environments from PyPI, two reloads each; the quality
# evaluation: perplexity, continuation, image grid) run in every test that does not pass these. A test that is not
# about the evaluation or the matrix passes them on its own command line, for speed (docs/development.md, "The
# tiers"); `verify` has no evaluation: it takes "--compat", "none" alone.
SKIP_EVAL_AND_MATRIX = ["--eval-budget", "0", "--compat", "none"]
# The fresh-interpreter reloads of a default verification read the saved folder on this disk, never the Hub: the
# transfer mode changes nothing in them. Tests marked `transfer` that run them for other reasons (the token never
# written, the CLI's output) keep them in the Xet session, the users' default, and verify in process in the LFS one,
# where only the transfers differ. (test_job.py's pipeline publish keeps the default verification in both.)
XET_DEFAULT_VERIFY = [] if TRANSFER == "xet" else IN_PROCESS


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


# The CLI run in-process (the cli fixture, CliRunner: stderr is no terminal) turns progress bars off for itself and
# the processes it starts by setting these (publisher/runtime/progress.py); they end with the test that ran it.
PROGRESS_VARS = ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE")


@pytest.fixture(autouse=True)
def _progress_vars_restored() -> Any:
    saved = {name: os.environ.get(name) for name in PROGRESS_VARS}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# What progress bars leave in a log that is no terminal: carriage returns, escape codes, rates, tqdm's bar edge, and
# the bars' own texts (huggingface_hub and hf_xet, transformers, diffusers, our streaming engine's).
BAR_MARKS = ("\r", "\x1b", "it/s", "B/s", "%|", "Processing Files", "New Data Upload", "Validating", "LFS files",
             "Loading weights", "Writing model shards", "Loading pipeline components", "Fetching", "quantize Flux")


def progress_bars(stderr: str) -> list[str]:
    """The lines of ``stderr`` (split on newlines only, so a bar's redraws stay in its line) a progress bar drew."""
    return [line for line in stderr.split("\n") if any(mark in line for mark in BAR_MARKS)]


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


def download_fault(hub: Any, how: str, match: str, *, at: int = 0, count: int = 1) -> str:
    """Damage downloads where this session's downloads flow: hf_xet's CAS with Xet (the file's first xorb; ``at`` is
    ignored), the HTTP body with Xet off (``at``: the byte flipped, or where the body is cut). ``how``: "flip" or
    "truncate". Returns the fault kind that ``hub.faults_fired`` will count."""
    if TRANSFER == "xet":
        hub.set_fault(**{f"xet_{how}": True}, match=match, count=count)
        return f"xet_{how}"
    hub.set_fault(**{"flip_byte_at" if how == "flip" else "truncate_body_at": at}, match=match, count=count)
    return how


def distinct_copy(src: Path, dst: Path, salt: int) -> Path:
    """A copy of a model folder whose safetensors weights differ from ``src``'s (one value changed per file), so that
    no cache holds them yet: with Xet, huggingface_hub's cache-wide shared blob store deduplicates files by content
    across repos, and a test of what a download does needs a download to happen."""
    import safetensors.torch

    shutil.copytree(src, dst)
    for path in sorted(dst.rglob("*.safetensors")):
        with safetensors.safe_open(str(path), "pt") as f:
            metadata = f.metadata()
        tensors = safetensors.torch.load_file(str(path))
        name = next(k for k, t in sorted(tensors.items()) if t.is_floating_point() and t.numel() > 1)
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] += salt * 2.0**-6
        safetensors.torch.save_file(tensors, str(path), metadata=metadata)
    return dst


def run_snippet(code: str, cwd: Path, env: dict[str, str], timeout: float) -> Any:
    """What ``python -c CODE`` in ``cwd`` gives (a ``subprocess.CompletedProcess``), as a user pastes a card snippet
    into a new interpreter, forked from a zygote of this interpreter (publisher/runtime/zygotes.py, as the verify
    workers are): it has imported torch and the libraries' model base classes (what every snippet imports first,
    directly or through diffusers or transformers), and nothing else, so a snippet costs its own work and not those
    imports again; what they print when imported is at the head of its stdout and stderr, as in a new interpreter.
    The code is a file in ``cwd``, so ``sys.path[0]`` is ``cwd`` as with ``-c``."""
    import hashlib
    import sys

    from publisher.runtime import zygotes

    script = cwd / f"snippet_{hashlib.sha256(code.encode()).hexdigest()[:12]}.py"
    script.write_text(code)
    return zygotes.run(sys.executable, script, [], env=env, timeout=timeout, outputs=script.with_suffix(""), cwd=cwd,
                       preload=zygotes.LIBRARIES)


def seed(repo_id: str, folder: Path, token: str, **kwargs: Any) -> str:
    """Upload a local model folder as a Hub repo; returns its commit sha."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, exist_ok=True, **kwargs)
    return api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message="seed").oid


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
# `make test` runs `--dist loadscope`, with the scheduler below: a test file stays on one worker (its module-scoped
# fixtures, a publish or a corpus, are built once), as `--dist loadfile` kept every file, except the files named in
# SPREAD, which share nothing but session fixtures (each worker builds its own): their tests go one by one to
# whichever worker is free (before, the 25 family publishes sat on one worker). xdist's own `loadgroup` marks do not
# take effect with pytest 9 (the group suffix it writes into a test's node id is not read back), hence a scheduler.
SPREAD = {"test_families", "test_job", "test_hub", "test_cli", "test_publish_configs", "test_family_failures",
          "test_hfjobs_e2e", "test_action", "test_one_pass", "test_signals", "test_quality_e2e", "test_local_inputs",
          "test_docs_commands", "test_quality_defaults"}
# Files in the order their work is handed out, the costliest first (seconds on 2 cores, `--durations` of a full run), so
# that no long test starts last and leaves the other worker idle; files not named here follow, in their usual order.
# Every file of more than a few seconds is named: test_zygotes (some 30 s on one worker), which came last by name,
# left the other worker idle for half a minute at the end of the run. test_verify_matrix as on a fresh clone (its
# environments built from PyPI: 30 s more than from the cache).
# The docs' commands first (minutes of publishes with the product's defaults, spread test by test); the Action's
# workflows (docs/action.md, one test of a few minutes) after them, so that their publishes of the same bases and
# recipes read the compatibility loads the commands measured (verify/memo.py) instead of measuring them again.
COST_ORDER = ["test_docs_commands", "test_families", "test_stages_card", "test_docs_action", "test_quality_defaults",
              "test_verify_full", "test_hfjobs_e2e", "test_job",
              "test_hub", "test_cli", "test_signals", "test_quality_e2e", "test_verify_matrix", "test_action",
              "test_scripts_gpu_check", "test_zygotes", "test_verify_streaming", "test_one_pass", "test_streaming_convert",
              "test_verify_peers", "test_testing_tiny", "test_integrity", "test_hostile_input", "test_hf_extension",
              "test_testing_hubserver", "test_publish_configs", "test_cli_bad_input", "test_action_run",
              "test_family_failures", "test_verify_envs"]


def _module(nodeid: str) -> str:
    return Path(nodeid.split("::", 1)[0]).stem


@pytest.hookimpl(optionalhook=True)  # xdist's hook: absent with -p no:xdist
def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
    """--dist loadscope with a scope per file, or per test for the files in SPREAD."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    # xdist would hand out the files with the most tests first, which puts the one-test scopes (the family publishes)
    # last; keep the collection's order, the costliest first (pytest_collection_modifyitems below)
    config.option.loadscopereorder = False

    class FileOrTestScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:  # the hook LoadScopeScheduling's subclasses override (loadfile's too)
            return nodeid if _module(nodeid) in SPREAD else nodeid.split("::", 1)[0]

    return FileOrTestScheduling(config, log)


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    rank = {name: i for i, name in enumerate(COST_ORDER)}
    items.sort(key=lambda item: rank.get(_module(item.nodeid), len(rank)))
