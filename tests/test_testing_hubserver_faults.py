"""The loopback Hub's body faults (a faulty link or proxy between the client and the Hub), seen by the real client:
a flipped byte keeps the size and ETag, a truncated body is a complete but short answer, a dropped body cuts the
connection mid-way, an ignored Range answers 200 with the whole file."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
from helpers import TRANSFER, seed

pytestmark = pytest.mark.slow  # a self-test of the test infrastructure

FILE = "transformer/diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def repo(hub: Any, tiny_flux_dir: Path) -> str:
    seed("bfl/faults-selftest", tiny_flux_dir, "tok_bfl")
    return "bfl/faults-selftest"


@pytest.fixture(autouse=True)
def _clean(hub: Any) -> Any:
    hub.clear_faults()
    yield
    hub.clear_faults()


def _url(repo: str) -> str:
    return f"{os.environ['HF_ENDPOINT']}/{repo}/resolve/main/{FILE}"


def _get(repo: str, headers: dict[str, str] | None = None) -> Any:
    import httpx2

    return httpx2.get(_url(repo), headers=headers or {}, follow_redirects=True)


def test_flip_keeps_size_and_etag_and_changes_one_byte(hub: Any, repo: str, tiny_flux_dir: Path) -> None:
    import httpx2

    good = (tiny_flux_dir / FILE).read_bytes()
    hub.set_fault(flip_byte_at=-3, match=FILE)
    head = httpx2.head(_url(repo))  # a HEAD is never touched, nor consumes the rule
    r = _get(repo)
    assert r.status_code == 200 and len(r.content) == len(good) == int(r.headers["Content-Length"])
    assert r.headers["ETag"] == head.headers["ETag"] == f'"{hashlib.sha256(good).hexdigest()}"'
    diff = [i for i, (a, b) in enumerate(zip(r.content, good)) if a != b]
    assert diff == [len(good) - 3] and r.content[-3] == good[-3] ^ 0xFF
    assert hub.faults_fired == {"flip": 1} and _get(repo).content == good  # used up


def test_flip_is_taken_only_by_a_range_that_covers_it(hub: Any, repo: str, tiny_flux_dir: Path) -> None:
    good = (tiny_flux_dir / FILE).read_bytes()
    hub.set_fault(flip_byte_at=100, match=FILE)
    assert _get(repo, {"Range": "bytes=0-9"}).content == good[:10]
    assert not hub.faults_fired
    part = _get(repo, {"Range": "bytes=90-109"}).content
    assert part[10] == good[100] ^ 0xFF and part[:10] == good[90:100]


def test_truncate_is_a_short_complete_answer_and_drop_cuts_the_connection(hub: Any, repo: str) -> None:
    import httpx2

    hub.set_fault(truncate_body_at=50, match=FILE)
    r = _get(repo)
    assert r.status_code == 200 and len(r.content) == 50 == int(r.headers["Content-Length"])
    hub.set_fault(drop_body_after_bytes=50, match=FILE)
    with pytest.raises(httpx2.RemoteProtocolError):
        _get(repo)


def test_ignore_range_answers_200_with_the_whole_file(hub: Any, repo: str, tiny_flux_dir: Path) -> None:
    hub.set_fault(ignore_range=True, match=FILE)
    r = _get(repo, {"Range": "bytes=8-15"})
    assert r.status_code == 200 and r.content == (tiny_flux_dir / FILE).read_bytes()
    assert _get(repo, {"Range": "bytes=8-15"}).status_code == 206


@pytest.mark.transfer
@pytest.mark.skipif(TRANSFER != "lfs", reason="huggingface_hub's HTTP download; a Xet download is hf_xet's (test_testing_hubserver_paths)")
def test_client_retries_a_dropped_body(hub: Any, repo: str, tiny_flux_dir: Path, tmp_path: Path) -> None:
    """huggingface_hub tries a cut download again by itself (resuming with a Range once it has written bytes)."""
    from huggingface_hub import hf_hub_download

    hub.set_fault(drop_body_after_bytes=1000, match=FILE)
    path = hf_hub_download(repo, FILE, cache_dir=tmp_path)
    assert Path(path).read_bytes() == (tiny_flux_dir / FILE).read_bytes()
    assert hub.faults_fired == {"drop_body": 1}


def test_admin_api_takes_the_body_faults_and_rejects_unknown_ones(hub: Any) -> None:
    import httpx2

    base = os.environ["HF_ENDPOINT"]
    r = httpx2.post(f"{base}/_admin/faults", json={"flip_byte_at": 5, "match": "x", "count": 2})
    assert r.status_code == 200 and r.json()["rules"][0]["kind"] == "flip" and r.json()["rules"][0]["count"] == 2
    assert httpx2.post(f"{base}/_admin/faults", json={"flip_bytes": 5}).status_code == 400


def test_a_held_request_counts_while_held_and_not_after_a_clear(hub: Any, repo: str) -> None:
    """requests_delayed_now: the requests a delay of the current rules holds (a test acts while its client waits); a
    request left held when a test clears its faults (its client killed, say) does not count for the next one."""
    import threading
    import time

    hub.set_fault(delay_s=1.0, match="/api/models/bfl/faults-selftest", count=2)
    assert hub.requests_delayed_now == 0
    calls = [threading.Thread(target=_get_info, args=(repo,)) for _ in range(2)]
    for call in calls:
        call.start()
    deadline = time.monotonic() + 10
    while hub.requests_delayed_now < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hub.requests_delayed_now == 2
    hub.clear_faults()
    assert hub.requests_delayed_now == 0  # both still sleep in their server threads
    for call in calls:
        call.join()
    assert hub.requests_delayed_now == 0


def _get_info(repo: str) -> None:
    import httpx2

    httpx2.get(f"{os.environ['HF_ENDPOINT']}/api/models/{repo}")
