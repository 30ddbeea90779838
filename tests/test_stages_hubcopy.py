"""stages/hubcopy.HubFile: every byte a Hub-to-Hub copy hands to an uploader is checked against the base's sha256,
whatever order the uploader reads in (one pass, huggingface_hub's multipart slices, a retried part, parallel parts,
the end first), and a flipped byte stops the upload before its last bytes. Reads go through the session's Hub
(``resolve/`` redirects to its storage bridge, as on huggingface.co)."""

from __future__ import annotations

import hashlib
import io
import os
import threading
from typing import Any

import pytest

from publisher.stages.hubcopy import HashMismatch, HubFile

SIZE = 3 * HubFile.BLOCK + 12_345
PART = 700_000  # not a multiple of the block: parts start inside blocks


@pytest.fixture(scope="module")
def base(hub: Any) -> tuple[str, bytes]:
    from huggingface_hub import HfApi, hf_hub_url

    data = os.urandom(SIZE)
    api = HfApi(token="tok_meta")
    api.create_repo("meta/hubfile", exist_ok=True)
    sha = api.upload_file(path_or_fileobj=data, path_in_repo="w.safetensors", repo_id="meta/hubfile").oid
    return hf_hub_url("meta/hubfile", "w.safetensors", revision=sha), data


@pytest.fixture(autouse=True)
def _no_faults(hub: Any) -> Any:
    hub.clear_faults()
    yield
    hub.clear_faults()


def _file(base: tuple[str, bytes], sha256: str | None = None) -> HubFile:
    url, data = base
    return HubFile(url, "tok_meta", len(data), sha256 or hashlib.sha256(data).hexdigest(), "meta/hubfile/w.safetensors")


def _slices(f: Any, order: list[int]) -> dict[int, bytes]:
    """huggingface_hub's multipart pattern (utils/_lfs.SliceFileObj): seek to the end and back, read one part."""
    out = {}
    for n in order:
        f.seek(0, io.SEEK_END)
        f.seek(n * PART)
        out[n] = f.read(PART)
    return out


def test_one_pass_and_slices_in_any_order_give_the_base_bytes(base: tuple[str, bytes]) -> None:
    data = base[1]
    with _file(base) as f:
        assert b"".join(f.chunks()) == data and f.transferred == SIZE
    parts = -(-SIZE // PART)
    for order in (list(range(parts)), list(reversed(range(parts))), [1, 0, 3, 2, 4, 0]):
        with io.BufferedReader(_file(base), buffer_size=HubFile.BLOCK) as f:
            got = _slices(f, order)
        assert all(got[n] == data[n * PART:(n + 1) * PART] for n in order)


def test_parallel_parts_are_each_checked(base: tuple[str, bytes]) -> None:
    data = base[1]
    f = _file(base)
    got: dict[int, bytes] = {}

    def part(n: int) -> None:
        buf = bytearray(PART)
        view, done = memoryview(buf), 0
        while done < PART:  # each thread reads its own offsets through the one object, as parallel slices would
            with lock:
                f.seek(n * PART + done)
                k = f.readinto(view[done:])
            if not k:
                break
            done += k
        got[n] = bytes(buf[:done])

    lock = threading.Lock()
    threads = [threading.Thread(target=part, args=(n,)) for n in range(-(-SIZE // PART))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert b"".join(got[n] for n in sorted(got)) == data
    f.close()


@pytest.mark.parametrize("at", [100, PART + 5, SIZE - 3])  # in part 1, in part 2, in the last bytes
def test_a_flipped_byte_in_any_part_stops_before_the_last_bytes(hub: Any, base: tuple[str, bytes], at: int) -> None:
    hub.set_fault(flip_byte_at=at, match="/meta/hubfile/resolve/")
    with io.BufferedReader(_file(base), buffer_size=HubFile.BLOCK) as f:
        with pytest.raises(HashMismatch, match="stopped before its last bytes"):
            _slices(f, list(range(-(-SIZE // PART))))
    assert hub.faults_fired == {"flip": 1}


def test_a_retried_part_must_bring_the_same_bytes(hub: Any, base: tuple[str, bytes]) -> None:
    with io.BufferedReader(_file(base), buffer_size=HubFile.BLOCK) as f:
        _slices(f, [0, 1, 2, 3, 4])  # the whole file once: hashed and checked
        hub.set_fault(flip_byte_at=PART + 5, match="/meta/hubfile/resolve/")
        with pytest.raises(HashMismatch, match="differ from the first read of them"):
            _slices(f, [1])  # part 2 sent again: its bytes come again, one of them flipped
        with pytest.raises(HashMismatch):  # and the file stays refused
            _slices(f, [0])


def test_bytes_that_are_not_the_bases_never_complete_a_read(base: tuple[str, bytes]) -> None:
    f = _file(base, sha256="0" * 64)
    with pytest.raises(HashMismatch, match="its metadata says"):
        b"".join(f.chunks())
    with pytest.raises(HashMismatch):
        f.read(10)
