"""Local folders we do not own (publisher/io/localfiles.py; a mistyped one named as such), the JSON reader (publisher/io/jsonfile.py) and our own
leftovers (publisher/stages/unfinished.py): the rules the hostile-input suite relies on, one by one (fast)."""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from helpers import IN_PROCESS, SKIP_EVAL_AND_MATRIX

from publisher.errors import InputError, TargetError, UsageError
from publisher.io import jsonfile
from publisher.io.localfiles import allowed_roots, copy_regular, list_folder, named_folder, open_regular
from publisher.stages import unfinished


def test_links_inside_the_folder_are_read_as_their_target(tmp_path: Path) -> None:
    base = tmp_path / "base"
    (base / "shared").mkdir(parents=True)
    (base / "shared" / "tokenizer_config.json").write_text("{}")
    (base / "tokenizer_config.json").symlink_to("shared/tokenizer_config.json")
    assert list_folder(base) == {"shared/tokenizer_config.json": 2, "tokenizer_config.json": 2}
    out = tmp_path / "out.json"
    copy_regular(base / "tokenizer_config.json", out, allowed_roots(base))
    assert not out.is_symlink() and out.read_text() == "{}"


def test_a_download_cache_snapshot_may_link_into_its_blobs(tmp_path: Path) -> None:
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc").write_text('{"model_type": "llama"}')
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to("../../blobs/abc")
    assert list_folder(snapshot) == {"config.json": 23}
    assert jsonfile.read_object(snapshot / "config.json", roots=allowed_roots(snapshot)) == {"model_type": "llama"}
    (tmp_path / "elsewhere.txt").write_text("secret")
    (snapshot / "LICENSE").symlink_to(tmp_path / "elsewhere.txt")
    with pytest.raises(InputError, match="links that leave it or lead nowhere: LICENSE -> ") as exc:
        list_folder(snapshot)
    assert exc.value.kind == "link"
    with pytest.raises(InputError, match="outside"):
        open_regular(snapshot / "LICENSE", allowed_roots(snapshot))


def test_a_fifo_is_refused_without_being_opened_for_reading(tmp_path: Path) -> None:
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    done = threading.Event()

    def attempt() -> None:
        with pytest.raises(InputError, match="is a FIFO, not a regular file"):
            open_regular(fifo)
        with pytest.raises(InputError, match="is a FIFO"):
            jsonfile.read_object(fifo)
        done.set()

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert done.is_set(), "opening a FIFO blocked"


def test_copies_never_write_through_a_link(tmp_path: Path) -> None:
    (tmp_path / "src.txt").write_text("data")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (tmp_path / "dst.txt").symlink_to(victim)
    with pytest.raises(OSError):
        copy_regular(tmp_path / "src.txt", tmp_path / "dst.txt")
    assert victim.read_text() == "keep"


def test_json_limits_are_checked_before_reading(tmp_path: Path) -> None:
    big = tmp_path / "config.json"
    with open(big, "wb") as f:
        f.truncate(jsonfile.CONFIG_LIMIT + 1)  # sparse: nothing to parse, and nothing is read
    with pytest.raises(InputError, match="over the 16 MiB limit") as exc:
        jsonfile.read_object(big)
    assert exc.value.kind == "json-size"
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "x.safetensors"}, "pad": " " * (jsonfile.CONFIG_LIMIT + 1)}))
    assert jsonfile.weight_map(jsonfile.read_object(index), str(index)) == {"a": "x.safetensors"}  # indexes: 64 MiB
    with pytest.raises(InputError, match="gives tensor 'a' the shard 3"):
        jsonfile.weight_map({"weight_map": {"a": 3}}, "x")


def test_torch_dtypes_for_every_byte_sized_safetensors_dtype() -> None:
    import torch

    from publisher.errors import QuantizeError
    from publisher.streaming.safetensors_io import torch_dtype
    from publisher.streaming.validate import DTYPE_BITS

    assert torch_dtype("F8_E8M0") is torch.float8_e8m0fnu
    for name, bits in DTYPE_BITS.items():
        if bits % 8 == 0:
            assert torch.empty(0, dtype=torch_dtype(name)).element_size() * 8 == bits
        else:
            with pytest.raises(QuantizeError, match=f"holds {name} tensors"):
                torch_dtype(name)


# ---- a folder named as MODEL_ID or TARGET ----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["./out-pipee", "out-pipee/", "out/pipee", "../nowhere/x", "~/no-such-folder-here/x",
                                  "/no/such/folder"])
def test_a_name_written_as_a_path_that_does_not_exist_is_no_such_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    (tmp_path / "out").mkdir()  # "out/pipee" is a path because out/ exists here
    (tmp_path / "out-pipe").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=rf"^no such folder: {re.escape(name)}[ ;].*give an existing folder as TARGET"):
        named_folder(name, "TARGET")


def test_no_such_folder_names_the_closest_folder_as_it_was_typed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "out-pipe").mkdir()
    (tmp_path / "out-pipes.txt").write_text("a file, not a folder")
    monkeypatch.chdir(tmp_path)
    for typed, meant in (("./out-pipee", "./out-pipe"), ("out-pipee/", "out-pipe"), (f"{tmp_path}/out-pip", f"{tmp_path}/out-pipe")):
        with pytest.raises(UsageError, match=rf"^no such folder: {re.escape(typed)} \(did you mean {re.escape(meant)}\?\); "):
            named_folder(typed, "MODEL_ID")


def test_repo_ids_and_existing_folders_pass_a_file_does_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "weights.safetensors").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    for name in ("alice/model", "gpt2", "model", "./model", "model/", str(tmp_path / "model")):
        named_folder(name, "MODEL_ID")  # a repo id (no folder "alice" here), or a folder that exists
    with pytest.raises(UsageError, match=r"^MODEL_ID weights.safetensors is a file, not a folder; give the folder"):
        named_folder("weights.safetensors", "MODEL_ID")


# ---- our own leftovers -----------------------------------------------------------------------------------------
def test_a_cleared_folder_is_said_to_be_left_by_a_run_that_did_not_finish(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Interrupted, or stopped by an error (a --min-quality bound, a crash): the line says what is known."""
    out = tmp_path / "out"
    unfinished.make_partial(out / "int8wo.partial", "f" * 64, "int8wo")
    with caplog.at_level("INFO", logger="publisher.stages.unfinished"):
        unfinished.clear_output_dir(out)
    assert [r.getMessage() for r in caplog.records] == [
        f"removing {out / 'int8wo.partial'}, left by an earlier run that did not finish (interrupted or failed; int8wo)"]


def test_only_marked_partial_folders_are_cleared(tmp_path: Path) -> None:
    out = tmp_path / "out"
    unfinished.make_partial(out / "int8wo.partial", "f" * 64, "int8wo")
    (out / "int8wo.partial" / "model.safetensors").write_bytes(b"x")
    unfinished.make_partial(out / ".hf-ao-publish.partial", "0" * 64, "float8wo")  # another run's inputs: ours too
    unfinished.clear_output_dir(out)
    assert list(out.iterdir()) == []

    for name, make in {
        "no marker": lambda p: p.mkdir(),
        "marker of another tool": lambda p: (p.mkdir(), (p / unfinished.MARKER).write_text('{"tool": "x"}')),
        "marker not JSON": lambda p: (p.mkdir(), (p / unfinished.MARKER).write_text("{")),
        "marker a link": lambda p: (p.mkdir(), (p / unfinished.MARKER).symlink_to(tmp_path / "elsewhere.json")),
    }.items():
        (tmp_path / "elsewhere.json").write_text(json.dumps({"tool": "hf-ao-publish", "fingerprint": "f" * 64, "recipe": "x"}))
        folder = out / "mine.partial"
        make(folder)
        (folder / "thesis.tex").write_text("years of work")
        with pytest.raises(TargetError, match="mine.partial is not an unfinished folder of hf-ao-publish"):
            unfinished.clear_output_dir(out)
        with pytest.raises(TargetError, match="is in the way"):
            unfinished.remove_partial(folder)
        assert (folder / "thesis.tex").read_text() == "years of work", name
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()


def test_the_marker_never_reaches_the_repo_or_the_resume_cache(tmp_path: Path) -> None:
    from publisher.handoffs.artifacts import Artifacts
    from publisher.recipes import get
    from publisher.stages.unfinished import ComponentCache, finalize

    partial = tmp_path / "out" / "int8wo.partial"
    unfinished.make_partial(partial, "a" * 64, "int8wo")
    (partial / "config.json").write_text("{}")
    artifacts = Artifacts(recipe=get("int8wo"), folder=partial, components=[])
    assert artifacts.files() == {"config.json": 2}
    cache = ComponentCache(tmp_path / "cache", "a" * 64)
    cache.store("", partial, {})
    restored = tmp_path / "restored"
    restored.mkdir()
    cache.load("", restored)
    assert sorted(p.name for p in restored.iterdir()) == ["config.json"]
    final = tmp_path / "out" / "int8wo"
    finalize(artifacts, final)
    assert sorted(p.name for p in final.iterdir()) == ["config.json"]


@pytest.mark.slow
def test_a_base_with_links_inside_publishes_plain_files(cli: Any, tiny_llama_dir: Path, tmp_path: Path) -> None:
    """End to end: a link that stays inside the base folder is followed, and the output gets a plain file."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(tiny_llama_dir, base)
    (base / "shared").mkdir()
    (base / "tokenizer_config.json").rename(base / "shared" / "tokenizer_config.json")
    (base / "tokenizer_config.json").symlink_to("shared/tokenizer_config.json")
    out = tmp_path / "out"
    result = cli(str(base), "--quant", "int8wo", "--no-push", "--output-dir", str(out), *IN_PROCESS,
                 *SKIP_EVAL_AND_MATRIX)  # the subject: links
    assert result.exit_code == 0, result.output
    copied = out / "tokenizer_config.json"
    assert copied.is_file() and not copied.is_symlink()
    assert copied.read_bytes() == (base / "shared" / "tokenizer_config.json").read_bytes()
    assert [p for p in out.rglob("*") if p.is_symlink()] == []
    assert not list(out.rglob(unfinished.MARKER)) and not list(tmp_path.rglob("*.partial"))


def test_only_the_marked_shared_store_counts_as_shared_blobs(tmp_path: Path) -> None:
    """A cache entry whose blob links into huggingface_hub's marked shared store is a shared Xet copy (repaired in
    place, never deleted); a blob a user linked elsewhere is not, so nothing outside the cache is ever overwritten."""
    from publisher.io.downloads import shared_copy
    from publisher.io.localfiles import SHARED_BLOBS_MARKER

    cache = tmp_path / "hub"
    repo = cache / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc").mkdir(parents=True)
    store = cache / "blobs" / "ab"
    store.mkdir(parents=True)
    (store / "xethash").write_bytes(b"x")
    elsewhere = tmp_path / "other-disk" / "weights"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(b"x")
    for name, target in (("shared", store / "xethash"), ("user", elsewhere)):
        (repo / "blobs" / name).symlink_to(target)
        (repo / "snapshots" / "abc" / f"{name}.bin").symlink_to(Path("../../blobs") / name)
    link = repo / "snapshots" / "abc"
    assert not shared_copy(link / "shared.bin")  # no marker: not huggingface_hub's shared store
    (cache / "blobs" / SHARED_BLOBS_MARKER).write_text("")
    assert shared_copy(link / "shared.bin") and not shared_copy(link / "user.bin")
