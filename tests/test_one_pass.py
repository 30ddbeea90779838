"""Issue 16: one pass. The forward checks run during quantization, the unchanged files go Hub to Hub, the pushed
commit is proved by its file hashes, and the output shard size is a choice."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from helpers import IN_PROCESS, SKIP_EVAL_AND_MATRIX, TRANSFER, ranged_bytes, seed

from publisher import recipes

SMALL = ["--sample-steps", "2", "--sample-size", "64"]


# ------------------------------------------------------------------ the forward during quantization

def _in_pass(src: Path, out: Path, library: str, cls: str, recipe: str = "int8wo") -> tuple[Any, Any, Any]:
    from publisher.loadpath import load_call
    from publisher.streaming import StreamJob, stream_quantize
    from publisher.verify import capture
    from publisher.verify.inpass import InPassForward

    # the inputs a run derives from the base (verify/capture.py): a pipeline's recorded call, or seeded token ids
    root = src.parent if (src.parent / "model_index.json").is_file() else src
    name = src.name if root != src else ""
    pipeline = json.loads((root / "model_index.json").read_text())["_class_name"] if name else None
    spec = capture.for_components(root, pipeline, {name: (library, cls)}, out.parent / "inputs")[name]
    assert spec.file is not None, spec.reason
    inputs = load_call(spec.file)
    config = json.loads((src / "config.json").read_text())
    observer = InPassForward(library, cls, config, inputs)
    job = StreamJob(src, out, library=library, recipe=recipes.get(recipe), class_name=cls, progress=False,  # type: ignore[arg-type]
                    max_shard_size="200KB")
    res = stream_quantize(job, observer=observer)
    return observer, res, inputs


@pytest.mark.parametrize("sub,library,cls", [("transformer", "diffusers", "FluxTransformer2DModel"),
                                             ("", "transformers", "LlamaForCausalLM")])
def test_forward_during_the_pass_equals_the_block_forwards_of_the_saved_files_and_the_base(
        tiny_flux_dir: Path, tiny_llama_dir: Path, tmp_path: Path, sub: str, library: str, cls: str) -> None:
    """Bit for bit: the quantized output is the block-by-block forward of the saved files (what every reload must
    give), the base output the block-by-block forward of the bf16 checkpoint (what the quality figures used)."""
    import torch

    from publisher.streaming.shards import LocalShards
    from publisher.verify import streaming as vs

    src = tiny_flux_dir / sub if sub else tiny_llama_dir
    observer, _, inputs = _in_pass(src, tmp_path / "out", library, cls)
    result = observer.result()
    assert result.output is not None, result.detail
    assert result.blocks > 10 and "forward during quantization" in result.detail
    saved = vs.block_forward(LocalShards(tmp_path / "out"), library, cls, vs.load_config(LocalShards(tmp_path / "out")), inputs)
    base = vs.block_forward(LocalShards(src), library, cls, json.loads((src / "config.json").read_text()), inputs)
    assert torch.equal(result.output, saved.output) and torch.equal(result.base_output, base.output)
    assert not torch.equal(result.output, result.base_output)  # quantization did change something


def test_the_pass_reads_in_execution_order_and_each_tensor_once(tiny_flux_dir: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from publisher.streaming import safetensors_io as stio

    reads: list[int] = []
    real = stio.read_tensor

    def counting(f: Any, entry: Any) -> Any:
        reads.append(entry.end - entry.begin)
        return real(f, entry)

    monkeypatch.setattr(stio, "read_tensor", counting)
    observer, res, _ = _in_pass(tiny_flux_dir / "transformer", tmp_path / "out", "diffusers", "FluxTransformer2DModel")
    _, header = stio.read_header(tiny_flux_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    data = sum(e.end - e.begin for e in header.values())
    assert sum(reads) == data  # every tensor read once, the forward passes included
    assert observer.calls[0] == "x_embedder." and observer.result().output is not None


def test_a_forward_that_leaves_the_traced_order_gives_up_and_the_pass_goes_on(tiny_flux_dir: Path, tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The real forward calls its blocks in another order than the meta-device trace: the observer gives up (the
    verification then runs the forward after the pass) and the quantized files are unaffected."""
    from publisher.verify import inpass

    real_plan = inpass.InPassForward._plan

    def swapped(self: Any, readable: set[str]) -> Any:
        order = real_plan(self, readable)
        self.calls[1], self.calls[2] = self.calls[2], self.calls[1]
        return order

    monkeypatch.setattr(inpass.InPassForward, "_plan", swapped)
    observer, res, _ = _in_pass(tiny_flux_dir / "transformer", tmp_path / "out", "diffusers", "FluxTransformer2DModel")
    result = observer.result()
    assert result.output is None and "where the meta-device trace had" in result.detail
    assert res.digests and (tmp_path / "out" / "diffusion_pytorch_model.safetensors.index.json").is_file()


def test_a_forward_that_holds_too_much_gives_up(tiny_flux_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from publisher.verify import inpass

    monkeypatch.setattr(inpass, "MAILBOX_BUDGET", 0)
    monkeypatch.setattr(inpass, "MAILBOX_LIMIT", 1)
    observer, _, _ = _in_pass(tiny_flux_dir / "transformer", tmp_path / "out", "diffusers", "FluxTransformer2DModel")
    assert observer.result().output is None and "would hold more than" in observer.result().detail


# ------------------------------------------------------------------ hashes: the loopback Hub and the check

def test_the_loopback_hub_reports_file_hashes_like_the_hub(hub: Any, tiny_flux_dir: Path) -> None:
    from huggingface_hub import HfApi

    from publisher.verify.commit_hashes import git_blob_id

    seed("bfl/hashes", tiny_flux_dir, "tok_bfl")
    api = HfApi()
    paths = ["transformer/diffusion_pytorch_model.safetensors", "model_index.json"]
    infos = {i.path: i for i in api.get_paths_info("bfl/hashes", paths)}
    siblings = {s.rfilename: s for s in api.model_info("bfl/hashes", files_metadata=True).siblings or []}
    weights, index = (tiny_flux_dir / p for p in paths)
    sha = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert infos[paths[0]].lfs.sha256 == siblings[paths[0]].lfs.sha256 == sha  # type: ignore[union-attr]
    assert infos[paths[0]].size == siblings[paths[0]].size == weights.stat().st_size
    assert infos[paths[1]].lfs is None and siblings[paths[1]].lfs is None
    assert infos[paths[1]].blob_id == siblings[paths[1]].blob_id == git_blob_id(index.read_bytes())


def test_the_hash_check_names_a_changed_a_missing_and_an_extra_file(hub: Any, tiny_llama_dir: Path) -> None:
    from huggingface_hub import HfApi

    from publisher.verify.commit_hashes import check_commit, of_file

    sha = seed("alice/hash-check", tiny_llama_dir, "tok_alice")
    expected = {p.relative_to(tiny_llama_dir).as_posix(): of_file(p) for p in tiny_llama_dir.rglob("*") if p.is_file()}
    expected[".gitattributes"] = of_file(Path(__file__).parent / "conftest.py")  # replaced below
    good = check_commit("alice/hash-check", sha, {k: v for k, v in expected.items() if k != ".gitattributes"}, "tok_alice")
    assert not good.ok and ".gitattributes is on the Hub but was not published by this run" in good.detail
    expected.pop(".gitattributes")
    api = HfApi(token="tok_alice")
    gitattributes = api.hf_hub_download("alice/hash-check", ".gitattributes", revision=sha)
    expected[".gitattributes"] = of_file(Path(gitattributes))
    ok = check_commit("alice/hash-check", sha, expected, "tok_alice")
    assert ok.ok and ok.path == "hashes" and f"{len(expected)} files equal to the verified bytes" in ok.detail
    changed = api.upload_file(path_or_fileobj=b"tampered", path_in_repo="config.json", repo_id="alice/hash-check").oid
    bad = check_commit("alice/hash-check", changed, expected, "tok_alice")
    assert not bad.ok and "config.json has git blob" in bad.detail
    weights = next(k for k in expected if k.endswith(".safetensors"))
    swapped = api.upload_file(path_or_fileobj=b"\0" * 64, path_in_repo=weights, repo_id="alice/hash-check").oid
    bad = check_commit("alice/hash-check", swapped, {k: v for k, v in expected.items() if k != "config.json"}, "tok_alice")
    assert not bad.ok and bad.detail.startswith("2 of 6 files differ") and f"{weights} has sha256" in bad.detail
    missing = check_commit("alice/hash-check", sha, {**expected, "extra.json": expected["config.json"]}, "tok_alice")
    assert not missing.ok and "extra.json is missing" in missing.detail


@pytest.mark.slow
def test_a_pull_request_whose_files_are_not_the_verified_bytes_is_closed(cli: Any, flux_repo: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hub holds something else than what was verified (here: the record of the card's hash is off): the pull
    request is closed, nothing is merged, the repo made for it is deleted."""
    from huggingface_hub import HfApi

    from publisher.stages import lowdisk_push
    from publisher.verify.commit_hashes import CommitFile, of_operation

    def off(op: Any) -> CommitFile:
        got = of_operation(op)
        return CommitFile(got.size, got.sha256, "0" * 40) if op.path_in_repo == "README.md" else got

    monkeypatch.setattr(lowdisk_push, "of_operation", off)
    result = cli(flux_repo, "--quant", "int8wo", "--low-disk", "--repo-id", "alice/lowdisk-wrong-hash", *SKIP_EVAL_AND_MATRIX,
                 token="tok_alice")
    assert result.exit_code == 1
    assert "does not hold the verified bytes: 1 of" in result.stderr and "README.md has git blob" in result.stderr
    assert not HfApi(token="tok_alice").repo_exists("alice/lowdisk-wrong-hash")


# ------------------------------------------------------------------ the unchanged files, Hub to Hub

def _base_with_a_virtual_text_encoder(hub: Any, tiny_flux_dir: Path, repo: str, *, wrong_sha: bool = False,
                                      salt: int = 7) -> int:
    """Seed ``repo`` and replace its text encoder's weights with a virtual file: an LFS object the Hub's store does not
    hold (its bytes are computed as they are served), so a copy must move it; once a copy has moved it, the Hub holds
    it, so each test that needs a copy to happen takes its own ``salt``. Returns its size."""
    from publisher.testing.virtual import safetensors_file

    seed(repo, tiny_flux_dir, "tok_bfl")
    vf = safetensors_file([("text_model.w", (512, 1024)), ("text_model.b", (1024,))], seed=salt)
    sha = vf.sha256() if not wrong_sha else hashlib.sha256(b"something else").hexdigest()
    hub.app.add_virtual({"repo_id": repo, "files": {"text_encoder/model.safetensors": {**vf.to_json(), "sha256": sha}}})
    return vf.size


@pytest.mark.slow
@pytest.mark.transfer
def test_an_object_the_target_hub_lacks_streams_from_the_base_with_its_sha256_checked(cli: Any, hub: Any, tiny_flux_dir: Path,
                                                                                      tmp_path: Path) -> None:
    from huggingface_hub import HfApi

    from publisher.testing.virtual import safetensors_file

    size = _base_with_a_virtual_text_encoder(hub, tiny_flux_dir, "bfl/tiny-flux-virtual")
    out = tmp_path / "out"
    result = cli("bfl/tiny-flux-virtual", "--quant", "int8wo", "--low-disk", "--output-dir", str(out), "--json",
                 "--repo-id", "alice/virtual-copy", *SKIP_EVAL_AND_MATRIX, token="tok_alice")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    copied = {c["path"]: c for c in data["copied_from_base"]}
    assert copied["text_encoder/model.safetensors"]["transferred"] == size  # streamed through, once
    vae = copied["vae/diffusion_pytorch_model.safetensors"]
    # LFS: the target's batch answers that this Hub holds the object, nothing moves; Xet: hf_xet chunks every byte
    # (the Hub's dedup then keeps them from being stored twice), as huggingface_hub's own uploads do
    assert vae["transferred"] == (0 if TRANSFER == "lfs" else vae["size"])
    assert not (out / "text_encoder").exists()
    info = {s.rfilename: s for s in HfApi().model_info("alice/virtual-copy", files_metadata=True).siblings or []}
    assert info["text_encoder/model.safetensors"].lfs.sha256 == safetensors_file(  # type: ignore[union-attr]
        [("text_model.w", (512, 1024)), ("text_model.b", (1024,))], seed=7).sha256()
    assert data["published_check"][0]["path"] == "hashes" and data["published_check"][0]["ok"]


@pytest.mark.slow
@pytest.mark.transfer
def test_base_bytes_that_do_not_match_their_oid_are_never_published(cli: Any, hub: Any, tiny_flux_dir: Path) -> None:
    """The base's metadata announces one sha256 and its bytes have another: the copy stops before the last byte,
    the run fails naming the file, and the repo made for it is deleted."""
    from huggingface_hub import HfApi

    _base_with_a_virtual_text_encoder(hub, tiny_flux_dir, "bfl/tiny-flux-corrupt", wrong_sha=True)
    result = cli("bfl/tiny-flux-corrupt", "--quant", "int8wo", "--low-disk", "--repo-id", "alice/corrupt-copy", *SKIP_EVAL_AND_MATRIX,
                 token="tok_alice")
    assert result.exit_code == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: bfl/tiny-flux-corrupt@") and "text_encoder/model.safetensors" in last
    assert "its metadata says" in last and "stopped before its last bytes" in last
    assert not HfApi(token="tok_alice").repo_exists("alice/corrupt-copy")


@pytest.mark.slow
@pytest.mark.transfer
def test_a_byte_flipped_in_one_part_of_a_copied_file_stops_the_copy(cli: Any, hub: Any, tiny_flux_dir: Path,
                                                                    fast_retries: None) -> None:
    """The virtual text encoder (1 MiB, an object the target Hub lacks) goes Hub to Hub: in parts with Xet off (the
    session's Hub asks for multipart above 1 MiB: three parts of 512 KiB), through hf_xet's stream otherwise. A byte
    flipped on its way from the base, inside the second part, stops the copy before its completion: nothing is
    committed, the repo made for it is gone."""
    from huggingface_hub import HfApi

    base, target = "bfl/copy-flip", "alice/copy-flip"
    _base_with_a_virtual_text_encoder(hub, tiny_flux_dir, base, salt=8)
    weights = "text_encoder/model.safetensors"
    hub.set_fault(flip_byte_at=600_000, match=weights)  # part 2; only the copy reads that far into the file
    hub.app.seen.clear()
    result = cli(base, "--quant", "int8wo", "--low-disk", "--repo-id", target, *SKIP_EVAL_AND_MATRIX, token="tok_alice")
    assert result.exit_code == 1, result.output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: ") and weights in last and "stopped before its last bytes" in last
    assert hub.faults_fired == {"flip": 1} and not HfApi(token="tok_alice").repo_exists(target)
    info = HfApi(token="tok_bfl").model_info(base, files_metadata=True)
    oid = next(s.lfs.sha256 for s in info.siblings or [] if s.rfilename == weights and s.lfs is not None)
    sent = [path for _, path, _ in hub.app.seen if path.startswith("/_lfs/") and oid in path]
    if TRANSFER == "lfs":  # its parts went up, its completion never did
        assert any("/_lfs/part/" in p for p in sent) and not any("/_lfs/complete/" in p for p in sent)
    else:
        assert sent == []  # no LFS at all: the copy streamed through Xet


@pytest.mark.slow
@pytest.mark.transfer
@pytest.mark.skipif(TRANSFER != "lfs", reason="a part sent again is the LFS multipart path")
def test_a_part_sent_again_is_read_and_checked_again(cli: Any, hub: Any, tiny_flux_dir: Path, fast_retries: None) -> None:
    """A part upload cut mid-body is sent again by huggingface_hub (its slice read once more from the base); the
    copy checks those bytes against the first read and completes."""
    base, target = "bfl/copy-retry", "alice/copy-retry"
    _base_with_a_virtual_text_encoder(hub, tiny_flux_dir, base, salt=9)
    hub.set_fault(drop_upload_after_bytes=100_000, match="/_lfs/part/")  # the first part of the text encoder's copy
    result = cli(base, "--quant", "int8wo", "--low-disk", "--repo-id", target, "--json", *SKIP_EVAL_AND_MATRIX, token="tok_alice")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["pushed"] and hub.faults_fired == {"drop_upload": 1}


# ------------------------------------------------------------------ options

@pytest.mark.parametrize("value", ["big", "0", "-2GB", "12XB"])
def test_max_shard_size_must_be_a_size(cli: Any, tiny_flux_dir: Path, value: str) -> None:
    result = cli(str(tiny_flux_dir), "--quant", "int8wo", "--no-push", "--max-shard-size", value)
    assert result.exit_code == 2 and "--max-shard-size" in result.stderr and "2GB" in result.stderr


@pytest.mark.slow
def test_max_shard_size_changes_only_the_shard_boundaries(cli: Any, tiny_flux_dir: Path, tmp_path: Path) -> None:
    """Streaming engine and library path give the same tensors in shards of the chosen size; the card says so."""
    import subprocess
    import sys

    outs = {}
    for engine in ("streaming", "library"):
        out = tmp_path / engine
        result = cli(str(tiny_flux_dir), "--quant", "int8wo", "--engine", engine, "--no-push", "--max-shard-size", "300KB",
                     "--output-dir", str(out), *SMALL, *IN_PROCESS, *SKIP_EVAL_AND_MATRIX)  # shards, not load paths
        assert result.exit_code == 0, result.output
        shards = sorted((out / "transformer").glob("*.safetensors"))
        assert len(shards) > 2 and all(p.stat().st_size <= 300_000 + 65_536 for p in shards)
        outs[engine] = out
    script = Path(__file__).resolve().parents[1] / "scripts" / "compare_checkpoints.py"
    proc = subprocess.run([sys.executable, str(script), str(outs["streaming"]), str(outs["library"])], capture_output=True, text=True)
    assert proc.returncode == 0 and " 0 differences" in proc.stdout, proc.stdout
    card = (outs["streaming"] / "README.md").read_text()
    assert "shards of at most 300.00 KB" in card and "transformer: 10GB" in card and "Only the shard boundaries" in card
    assert "--max-shard-size 300KB" in card  # the command in the card reproduces it


@pytest.mark.slow
def test_recheck_published_also_reads_the_commit_back(cli: Any, flux_repo: str) -> None:
    result = cli(flux_repo, "--quant", "int8wo", "--low-disk", "--recheck-published", "--repo-id", "alice/rechecked",
                 "--json", *SKIP_EVAL_AND_MATRIX, token="tok_alice")
    assert result.exit_code == 0, result.output
    checks = json.loads(result.stdout)["published_check"]
    assert [r["path"] for r in checks] == ["hashes", "streaming"]
    assert all(r["ok"] for r in checks) and checks[1]["forward_checked"] and checks[1]["tensors_checked"] > 0


# ------------------------------------------------------------------ one read for every recipe (issue 41)

def _ranged(hub: Any, repo: str, folder: str) -> int:
    """Bytes the loopback Hub (and its storage bridge) served by Range GETs of ``repo``'s files under ``folder``."""
    from huggingface_hub import HfApi

    return ranged_bytes(hub, f"/{repo}/resolve/{HfApi().model_info(repo).sha}/{folder}/")


def _weights(repo: str) -> dict[str, str]:
    """The sha256 of each weight file of ``repo``'s transformer, as the Hub reports it."""
    from huggingface_hub import HfApi

    info = HfApi().model_info(repo, files_metadata=True)
    return {s.rfilename: s.lfs.sha256 for s in info.siblings or []  # type: ignore[union-attr]
            if s.rfilename.startswith("transformer/") and s.rfilename.endswith(".safetensors")}


@pytest.mark.slow
def test_two_recipes_read_the_base_once_and_publish_what_two_runs_would(cli: Any, hub: Any, tiny_flux_dir: Path) -> None:
    """--low-disk with two recipes: the transformer's weights are read by range once for both (not once per recipe),
    each recipe's repo is published and verified, and its weights are those of a run of that recipe alone."""
    base = "bfl/tiny-flux-two-recipes"
    seed(base, tiny_flux_dir, "tok_bfl")
    base_bytes = sum(p.stat().st_size for p in (tiny_flux_dir / "transformer").glob("*.safetensors"))
    hub.app.seen.clear()
    result = cli(base, "--quant", "int8wo,float8wo", "--low-disk", "--repo-id", "alice/two-{recipe}", "--json",
                 *SKIP_EVAL_AND_MATRIX, token="tok_alice")
    assert result.exit_code == 0, result.output
    read = _ranged(hub, base, "transformer")
    assert base_bytes <= read <= 1.05 * base_bytes  # once, for both recipes
    data = json.loads(result.stdout)["results"]
    assert [(r["recipe"], r["pushed"], r["verified"]) for r in data] == [("int8wo", True, True), ("float8wo", True, True)]
    assert all(r["verification"]["mode"] == "streaming" and r["published_check"][0]["ok"] for r in data)
    for recipe in ("int8wo", "float8wo"):
        alone = cli(base, "--quant", recipe, "--low-disk", "--repo-id", f"alice/alone-{recipe}", *SKIP_EVAL_AND_MATRIX,
                    token="tok_alice")
        assert alone.exit_code == 0, alone.output
        weights = _weights(f"alice/two-{recipe}")
        assert weights and weights == _weights(f"alice/alone-{recipe}")  # bit for bit
    assert _weights("alice/two-int8wo") != _weights("alice/two-float8wo")


@pytest.mark.slow
def test_a_recipe_failing_in_the_shared_pass_is_dropped_and_the_others_publish(cli: Any, hub: Any, tiny_flux_dir: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """--keep-going: float8wo's quantize raises halfway through the one read; it is reported failed, its staged repo
    deleted, and int8wo goes on in the same pass and is published."""
    from huggingface_hub import HfApi

    from publisher.errors import QuantizeError
    from publisher.streaming import engine

    real, calls = engine._quantize, []

    def failing(ctx: Any, w: Any, raw: Any) -> Any:
        if "Float8Tensor" in ctx.plan.classes.values():
            calls.append(w.key)
            if len(calls) == 3:
                raise QuantizeError(f"float8wo: injected failure at {w.key}")
        return real(ctx, w, raw)

    monkeypatch.setattr(engine, "_quantize", failing)
    base = "bfl/tiny-flux-one-fails"
    seed(base, tiny_flux_dir, "tok_bfl")
    base_bytes = sum(p.stat().st_size for p in (tiny_flux_dir / "transformer").glob("*.safetensors"))
    hub.app.seen.clear()
    result = cli(base, "--quant", "int8wo,float8wo", "--low-disk", "--keep-going", "--repo-id", "alice/fails-{recipe}",
                 *SKIP_EVAL_AND_MATRIX, token="tok_alice")
    assert result.exit_code == 1 and len(calls) == 3
    assert "float8wo: FAILED" in result.stderr and "injected failure" in result.stderr
    assert "published alice/fails-int8wo" in result.stderr
    assert HfApi().repo_exists("alice/fails-int8wo") and not HfApi().repo_exists("alice/fails-float8wo")
    assert _ranged(hub, base, "transformer") <= 1.05 * base_bytes
