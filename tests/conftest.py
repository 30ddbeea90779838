"""Test isolation: a loopback Hub for the whole session, a private HF_HOME, no real token.

huggingface_hub reads HF_ENDPOINT, HF_HOME and HF_HUB_DISABLE_XET when it is imported, so they are
set here, at conftest import, before any test module imports it. The server is the project's own
(publisher.testing.hubserver); the client is the real, unmodified huggingface_hub.
"""

from __future__ import annotations

import os
import shutil
import socket
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
os.environ["HF_HUB_DISABLE_XET"] = "1"
os.environ["HF_HOME"] = str(_SESSION_DIR / "hf_home")
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
# Every publish would otherwise build and run the default compatibility matrix (a few environments from PyPI, two
# reloads each); the tests that measure it ask for it (tests/test_verify_matrix.py). Built environments are kept
# across test sessions (keyed by spec and by this environment), outside the throw-away HF_HOME.
os.environ["HF_AO_PUBLISH_COMPAT"] = "none"
os.environ.setdefault("HF_AO_PUBLISH_ENVS", str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                                                 / "hf-ao-publish-tests" / "envs"))

FAST_TRIES = 3  # HF_AO_PUBLISH_RETRIES under the fast_retries fixture


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch, hub: Any) -> Any:
    """Retries made fast (FAST_TRIES tries, 50 ms apart), and no loopback-Hub fault before or after the test."""
    monkeypatch.setenv("HF_AO_PUBLISH_RETRIES", str(FAST_TRIES))
    monkeypatch.setenv("HF_AO_PUBLISH_RETRY_DELAY", "0.05")
    hub.clear_faults()
    yield
    hub.clear_faults()


TOKENS = {"tok_alice": "alice", "tok_bob": "bob", "tok_bfl": "bfl", "tok_meta": "meta"}
ORGS = {"acme": ["alice"]}


@pytest.fixture(scope="session")
def hub() -> Any:
    from publisher.testing.hubserver import HubServer

    server = HubServer(_SESSION_DIR / "hub-data", tokens=TOKENS, orgs=ORGS, port=HUB_PORT)
    server.start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test sees a token unless it sets one."""
    monkeypatch.delenv("HF_TOKEN", raising=False)


@pytest.fixture(scope="session")
def tiny_flux_dir() -> Path:
    from publisher.testing.tiny import build_tiny_flux

    return build_tiny_flux(_SESSION_DIR / "models" / "tiny-flux")


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    from publisher.testing.tiny import build_tiny_llama

    return build_tiny_llama(_SESSION_DIR / "models" / "tiny-llama")


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
