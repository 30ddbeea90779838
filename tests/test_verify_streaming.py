"""Bounded-memory verification and bounded-disk input (issue 5): the streaming engine's in-memory digests,
tensor-by-tensor checks, block-by-block forward passes, --verify-mode and --low-disk through the real CLI."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from helpers import SKIP_EVAL_AND_MATRIX, TRANSFER, ranged_bytes, seed

from publisher import recipes

CPU_RECIPES = [r.name for r in recipes.all_recipes() if not r.needs_gpu_to_quantize]  # made on a CPU
SMALL = ["--sample-steps", "2", "--sample-size", "64"]
COMPONENTS = [("transformer", "diffusers", "FluxTransformer2DModel"), ("text_encoder_2", "transformers", "T5EncoderModel"),
              ("", "transformers", "LlamaForCausalLM")]


def _src(tiny_flux_dir: Path, tiny_llama_dir: Path, sub: str) -> Path:
    return tiny_llama_dir if not sub else tiny_flux_dir / sub


@pytest.fixture(scope="module")
def streamed(tiny_flux_dir: Path, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """stream_quantize results, cached per (component, recipe)."""
    from publisher.streaming import StreamJob, stream_quantize

    cache: dict[tuple[str, str], tuple[Path, Any]] = {}
    root = tmp_path_factory.mktemp("streamed")

    def get(sub: str, lib: str, cls: str, recipe: str) -> tuple[Path, Any]:
        if (sub, recipe) not in cache:
            out = root / f"{sub or 'llama'}-{recipe}"
            res = stream_quantize(StreamJob(_src(tiny_flux_dir, tiny_llama_dir, sub), out, library=lib,  # type: ignore[arg-type]
                                            recipe=recipes.get(recipe), class_name=cls, progress=False))
            cache[(sub, recipe)] = (out, res)
        return cache[(sub, recipe)]

    return get


@pytest.mark.parametrize("recipe", CPU_RECIPES)
@pytest.mark.parametrize("sub,lib,cls", COMPONENTS)
def test_engine_digests_equal_the_library_reload(streamed: Any, sub: str, lib: str, cls: str, recipe: str) -> None:
    """The digests the engine records in memory are those of the model a user loads (tied weights saved once)."""
    from publisher.loadpath import inspect_model, load_component

    out, res = streamed(sub, lib, cls, recipe)
    full = inspect_model(load_component(lib, cls, out))["digests"]
    assert res.digests, "no digests recorded"
    for name, digest in res.digests.items():
        assert full[name] == digest, name
    assert all(d in set(res.digests.values()) for d in full.values())


@pytest.mark.parametrize("sub,lib,cls", COMPONENTS)
def test_tensor_check_passes_and_catches_damage(streamed: Any, tmp_path: Path, sub: str, lib: str, cls: str) -> None:
    from publisher.streaming.shards import LocalShards
    from publisher.verify.streaming import check_tensors

    out, res = streamed(sub, lib, cls, "int8wo")
    good = check_tensors(LocalShards(out), res.digests, res.quantized, "Int8Tensor")
    assert good.ok and good.checked == len(res.digests) and good.quantized_layers == len(res.quantized) > 0

    wrong_class = check_tensors(LocalShards(out), res.digests, res.quantized, "Float8Tensor")
    assert not wrong_class.ok and "reloaded as Int8Tensor, expected Float8Tensor" in wrong_class.detail

    missing = check_tensors(LocalShards(out), {**res.digests, "extra.weight": "0" * 64}, res.quantized, "Int8Tensor")
    assert not missing.ok and "tensor extra.weight missing" in missing.detail

    # one byte flipped in a quantized weight's int8 data
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    from publisher.streaming import safetensors_io as stio

    shard = sorted(damaged.glob("*.safetensors"))[0]
    _, header = stio.read_header(shard)
    key = next(k for k in header if k.endswith("_weight_qdata"))
    with open(shard, "r+b") as f:
        f.seek(header[key].begin)
        b = f.read(1)
        f.seek(header[key].begin)
        f.write(bytes([b[0] ^ 0x01]))
    bad = check_tensors(LocalShards(damaged), res.digests, res.quantized, "Int8Tensor")
    assert not bad.ok and "differs from the in-memory quantized tensor" in bad.detail
    assert bad.detail.startswith(f"tensor {key.replace('._weight_qdata', '.weight')} ")


@pytest.mark.parametrize("budget", [0, 256 * 1024 * 1024])
@pytest.mark.parametrize("sub,lib,cls", [COMPONENTS[0], COMPONENTS[2]])
def test_block_forward_equals_a_full_reload(streamed: Any, tiny_flux_dir: Path, tiny_llama_dir: Path, tmp_path: Path,
                                            sub: str, lib: str, cls: str, budget: int) -> None:
    import torch

    from publisher.loadpath import forward, load_call, load_component
    from publisher.streaming.shards import LocalShards
    from publisher.verify.streaming import block_forward

    out, _ = streamed(sub, lib, cls, "int8wo")
    config = json.loads((out / "config.json").read_text())
    inputs = load_call(_recorded_inputs(tiny_flux_dir, tiny_llama_dir, sub, lib, cls, tmp_path))
    full = forward(load_component(lib, cls, out), lib, inputs)
    bf = block_forward(LocalShards(out), lib, cls, config, inputs, budget=budget)
    assert torch.equal(bf.output, full)
    if budget == 0:  # every module with weights is its own block: many loads, each small
        assert bf.blocks > 10 and bf.peak_block_bytes < sum(p.stat().st_size for p in out.glob("*.safetensors")) / 5
    else:
        assert bf.blocks == 1
    # the bf16 base the same way: equal to its full load too
    src = _src(tiny_flux_dir, tiny_llama_dir, sub)
    base = block_forward(LocalShards(src), lib, cls, json.loads((src / "config.json").read_text()), inputs, budget=budget)
    assert torch.equal(base.output, forward(load_component(lib, cls, src), lib, inputs))


def _recorded_inputs(flux: Path, llama: Path, sub: str, lib: str, cls: str, work: Path) -> Path:
    """The verification inputs of one component, derived as a publish derives them (verify/capture.py)."""
    from publisher.verify.capture import for_components

    folder, pipeline = (flux, "FluxPipeline") if lib == "diffusers" else (llama, None)
    found = for_components(folder, pipeline, {sub: (lib, cls)}, work)[sub]
    assert found.file is not None, found.reason
    return found.file


def _verify_results(data: dict[str, Any]) -> list[dict[str, Any]]:
    return list(data["verification"]["results"])


@pytest.mark.slow
def test_cli_streaming_verification(cli: Any, tiny_flux_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = cli(str(tiny_flux_dir), "--quant", "int8wo", "--components", "transformer,text_encoder_2", "--no-push",
                 "--output-dir", str(out), "--verify-mode", "streaming", "--json", *SMALL, *SKIP_EVAL_AND_MATRIX)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["verification"]["mode"] == "streaming" and data["verified"]
    results = _verify_results(data)
    assert {(r["component"], r["path"]) for r in results} == {("transformer", "streaming"), ("text_encoder_2", "streaming")}
    for r in results:
        assert r["ok"] and r["forward_checked"] and r["tensors_checked"] > 0 and r["quantized_layers"] > 0, r
    assert {q["component"] for q in data["quality"]} == {"transformer", "text_encoder_2"}
    assert all(q["cosine"] > 0.99 for q in data["quality"])
    card = (out / "README.md").read_text()
    assert "verified streaming, within a memory bound" in card and "| transformer | streaming |" in card


@pytest.mark.slow
def test_cli_streaming_verification_failure_pushes_nothing(cli: Any, flux_repo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor written differently from the one in memory (a disk fault) fails the run before any repo exists."""
    from huggingface_hub import HfApi

    from publisher.streaming import safetensors_io as stio

    real = stio.tensor_bytes
    state = {"done": False}

    def corrupting(t: Any) -> memoryview:
        data = real(t)
        if not state["done"] and str(t.dtype) == "torch.int8" and len(data) > 16:  # first quantized payload
            state["done"] = True
            flipped = bytearray(data)
            flipped[3] ^= 0xFF
            return memoryview(bytes(flipped))
        return data

    monkeypatch.setattr(stio, "tensor_bytes", corrupting)
    result = cli(flux_repo, "--quant", "int8wo", "--verify-mode", "streaming", "--repo-id", "alice/never-streamed",
                 *SKIP_EVAL_AND_MATRIX, token="tok_alice")
    assert result.exit_code == 1
    assert "differs from the in-memory quantized tensor" in result.stderr and "nothing was pushed" in result.stderr
    assert not HfApi(token="tok_alice").repo_exists("alice/never-streamed")


def _cached_weights(repo_id: str) -> list[Path]:
    hub_cache = Path(os.environ["HF_HOME"]) / "hub" / f"models--{repo_id.replace('/', '--')}"
    return [p for p in hub_cache.rglob("transformer/*.safetensors")] if hub_cache.exists() else []


@pytest.mark.transfer
@pytest.mark.slow
def test_low_disk_publish_reads_by_range_uploads_shards_and_merges_a_checked_pr(cli: Any, hub: Any, tiny_flux_dir: Path,
                                                                                 tmp_path: Path) -> None:
    import torch
    from diffusers import DiffusionPipeline
    from huggingface_hub import HfApi, hf_hub_download

    seed("bfl/tiny-flux-lowdisk", tiny_flux_dir, "tok_bfl")
    hub.app.seen.clear()
    out = tmp_path / "out"
    result = cli("bfl/tiny-flux-lowdisk", "--quant", "int8wo", "--low-disk", "--output-dir", str(out), "--json",
                 *SMALL, *SKIP_EVAL_AND_MATRIX, token="tok_alice")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    repo = "alice/tiny-flux-lowdisk-torchao-int8wo"
    assert data["verified"] and data["pushed"] and data["verification"]["mode"] == "streaming"
    # the base transformer's weights were read by HTTP range, each byte once, and never written to disk
    prefix = "/bfl/tiny-flux-lowdisk/resolve/"
    ranged = [p for m, p, r in hub.app.seen if r and p.startswith(prefix) and p.endswith(".safetensors")]
    assert any("transformer/diffusion_pytorch_model" in p for p in ranged)
    weights = (tiny_flux_dir / "transformer").glob("*.safetensors")
    base_bytes = sum(p.stat().st_size for p in weights)
    assert ranged_bytes(hub, prefix + f"{HfApi().model_info('bfl/tiny-flux-lowdisk').sha}/transformer/") <= 1.05 * base_bytes
    assert not _cached_weights("bfl/tiny-flux-lowdisk")
    # each output shard was uploaded (LFS, before any commit) and deleted; configs and the card stay
    assert not list((out / "transformer").glob("*.safetensors")) and (out / "transformer" / "config.json").is_file()
    assert "transformer/diffusion_pytorch_model.safetensors" in {f["name"] for f in data["files"]}
    # the components the run does not change went from the base repo to the target, never to disk
    for kept in ("text_encoder", "text_encoder_2", "vae", "tokenizer", "tokenizer_2"):
        assert not (out / kept).exists()
    hf_home = Path(os.environ["HF_HOME"])
    assert not [p for p in hf_home.rglob("*.safetensors") if "tiny-flux-lowdisk" in str(p)]
    copied = {c["path"]: c for c in data["copied_from_base"]}
    assert {"text_encoder/model.safetensors", "vae/diffusion_pytorch_model.safetensors", "LICENSE.md"} <= set(copied)
    # with Xet off, same Hub, same oid: nothing moved; through Xet hf_xet chunks every byte (the CAS dedups them)
    assert all(c["transferred"] == (0 if TRANSFER == "lfs" else c["size"]) for c in copied.values() if c["lfs"])
    names = {f["name"] for f in data["files"]}
    assert {"text_encoder/model.safetensors", "tokenizer/tokenizer.json", "model_index.json", "LICENSE.md"} <= names
    # committed as a pull request, checked there (the Hub's hashes), then merged
    prs = [d for d in HfApi(token="tok_alice").get_repo_discussions(repo) if d.is_pull_request]
    assert len(prs) == 1 and prs[0].status == "merged"
    results = data["verification"]["results"]
    # verified before the upload: tensors re-read from the local shard, forward during quantization, no second pass
    assert [r["env"] for r in results] == ["current, before upload"]
    assert results[0]["ok"] and results[0]["forward_checked"] and results[0]["tensors_checked"] > 0
    assert "forward during quantization" in results[0]["detail"]
    # execution order is not file order (x_embedder is stored last): read ahead of the hash, checked from the spill
    assert "read in execution order; at most" in result.stderr
    assert data["quality"] and data["quality"][0]["cosine"] > 0.99
    card = Path(hf_hub_download(repo, "README.md")).read_text()
    assert "Quality against the base" in card and "during the quantization pass" in card
    assert "shards of at most 2.00 GB" in card and "transformer: 10GB" in card
    # and the Hub holds exactly the verified bytes: every file's sha256 or git blob id, with nothing else
    published = data["published_check"]
    assert [r["path"] for r in published] == ["hashes"] and published[0]["ok"]
    assert f"{len(names)} files equal to the verified bytes" in published[0]["detail"]
    pipe = DiffusionPipeline.from_pretrained(repo, torch_dtype=torch.bfloat16)
    assert type(pipe.transformer.transformer_blocks[0].ff.net[2].weight).__name__ == "Int8Tensor"
    image = pipe("a cat", num_inference_steps=2, height=64, width=64, generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (64, 64)  # the copied components load and run


@pytest.mark.slow
@pytest.mark.parametrize("existing", [False, True])
def test_low_disk_publish_failing_on_the_pull_request_merges_nothing(cli: Any, flux_repo: str, tiny_llama_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch, existing: bool) -> None:
    """Without a forward pass during quantization the forward runs on the PR; it fails there: the PR is closed, main
    is untouched, a repo made by this run is deleted."""
    from huggingface_hub import HfApi

    from publisher.stages import quantize
    from publisher.verify import streaming as verify_stream

    api = HfApi(token="tok_alice")
    repo = f"alice/lowdisk-fails-{existing}"
    if existing:
        seed(repo, tiny_llama_dir, "tok_alice")
    head = api.repo_info(repo).sha if existing else None

    def broken(*a: Any, **k: Any) -> Any:
        raise RuntimeError("injected: the forward pass breaks")

    monkeypatch.setattr(quantize, "_in_pass_forward", lambda *args: None)  # the fallback: the forward after the pass
    monkeypatch.setattr(verify_stream, "block_forward", broken)
    result = cli(flux_repo, "--quant", "int8wo", "--low-disk", "--repo-id", repo, *SKIP_EVAL_AND_MATRIX, token="tok_alice")
    assert result.exit_code == 1
    assert "failed on the pull request" in result.stderr and "injected: the forward pass breaks" in result.stderr
    if existing:
        assert api.repo_info(repo).sha == head
        prs = [d for d in api.get_repo_discussions(repo) if d.is_pull_request]
        assert len(prs) == 1 and prs[0].status == "closed"
    else:
        assert not api.repo_exists(repo)


@pytest.mark.slow
def test_low_disk_publish_with_a_bad_shard_deletes_the_new_repo(cli: Any, flux_repo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard that does not match the in-memory tensors is never uploaded; the repo made for it goes again."""
    from huggingface_hub import HfApi

    from publisher.streaming import safetensors_io as stio

    real = stio.tensor_bytes

    def corrupting(t: Any) -> memoryview:
        data = real(t)
        if str(t.dtype) == "torch.int8" and len(data) > 16:
            flipped = bytearray(data)
            flipped[5] ^= 0xFF
            return memoryview(bytes(flipped))
        return data

    monkeypatch.setattr(stio, "tensor_bytes", corrupting)
    result = cli(flux_repo, "--quant", "int8wo", "--low-disk", "--repo-id", "alice/lowdisk-bad-shard", *SKIP_EVAL_AND_MATRIX,
                 token="tok_alice")
    assert result.exit_code == 1
    assert "differs from the in-memory quantized tensor after writing; nothing was published" in result.stderr
    assert not HfApi(token="tok_alice").repo_exists("alice/lowdisk-bad-shard")


def test_the_preflight_counts_the_read_ahead_spill_of_low_disk(cli: Any, flux_repo: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """--low-disk reads in execution order and keeps what it read ahead of each file's hash in the temp folder:
    the preflight counts it (the largest base weight file) and names TMPDIR when the disk is short."""
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    result = cli(flux_repo, "--quant", "int8wo", "--low-disk", "--no-push", "--output-dir", str(tmp_path / "out"))
    assert result.exit_code == 1, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("Error: not enough disk") and "read-ahead spill up to" in line and "TMPDIR" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_low_disk_is_chosen_when_the_download_would_not_fit(cli: Any, flux_repo: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from publisher.stages import preflight as resources

    monkeypatch.setattr(resources, "_fits", lambda est, out, cache: None if est.low_disk else (out, 10**12, 10**9))
    result = cli(flux_repo, "--quant", "int8wo", "--no-push", "--output-dir", str(tmp_path / "out"), *SMALL, *SKIP_EVAL_AND_MATRIX)
    assert result.exit_code == 0, result.output
    assert "reading the quantized components' weights by HTTP range instead (--low-disk)" in result.stderr
    result = cli(flux_repo, "--quant", "int8wo", "--no-push", "--output-dir", str(tmp_path / "out3"), "--benchmark", *SKIP_EVAL_AND_MATRIX)
    assert result.exit_code == 1 and "so the run would go --low-disk, and --benchmark runs the whole bf16 base" in result.stderr
    assert not (tmp_path / "out3").exists()
    monkeypatch.setattr(resources, "_fits", lambda est, out, cache: (out, 10**12, 10**9))
    result = cli(flux_repo, "--quant", "int8wo", "--no-push", "--output-dir", str(tmp_path / "out2"), *SKIP_EVAL_AND_MATRIX)
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1].startswith("Error: not enough disk")
    assert "--low-disk" not in result.stderr  # low-disk was tried (auto) and does not fit either


@pytest.mark.parametrize("args,message", [
    (["--verify-mode", "streaming", "--verify-env", "python3"], "--verify-env reloads whole components"),
    (["--low-disk", "--engine", "library"], "--low-disk reads weights by HTTP range"),
    (["--low-disk", "--benchmark"], "--benchmark runs the whole bf16 base"),
    (["--low-disk", "--verify-env", "python3", "--repo-id", "a/b"], "--verify-env has nothing to reload"),
])
def test_option_conflicts_are_usage_errors(cli: Any, tiny_flux_dir: Path, args: list[str], message: str) -> None:
    push = "--repo-id" in args  # the --verify-env conflict exists only with a push
    result = cli(str(tiny_flux_dir), "--quant", "int8wo", *([] if push else ["--no-push"]), *args)
    assert result.exit_code == 2 and message in result.stderr


@pytest.mark.parametrize("optional", [True, False])
def test_block_forward_failure_counts_unless_the_recipe_runs_on_a_gpu(streamed: Any, tmp_path: Path, tiny_flux_dir: Path,
                                                                       tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       optional: bool) -> None:
    """A CPU without a GPU recipe's kernel costs the forward check (said in the detail); any other failure fails."""
    from publisher.handoffs.report import Expected
    from publisher.streaming.shards import LocalShards
    from publisher.verify import streaming as verify_stream
    from publisher.verify.streaming import streaming_check

    out, res = streamed(*COMPONENTS[0], "int8wo")
    inputs = _recorded_inputs(tiny_flux_dir, tiny_llama_dir, *COMPONENTS[0], tmp_path)
    exp = Expected("transformer", "diffusers", COMPONENTS[0][2], inputs, None, dict(res.digests), res.quantized)

    def no_kernel(*a: Any, **k: Any) -> Any:
        raise RuntimeError("_scaled_mm only supports per-tensor scaling for CPU backend")

    monkeypatch.setattr(verify_stream, "block_forward", no_kernel)
    r = streaming_check(exp, LocalShards(out), "Int8Tensor", forward_optional=optional)
    assert r.ok is optional and not r.forward_checked and r.tensors_checked == len(res.digests)
    assert ("forward pass not checked on this CPU" in r.detail) if optional else r.detail.startswith("RuntimeError: _scaled_mm")


def test_shard_uploader_uploads_each_checked_shard_and_deletes_it(hub: Any, tiny_flux_dir: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Many small output shards: each leaves the disk once its tensors (parts may span shards) are checked."""
    from huggingface_hub import HfApi

    from publisher.stages.lowdisk_push import ShardUploader, ensure_repo
    from publisher.streaming import StreamJob, stream_quantize

    monkeypatch.setenv("HF_TOKEN", "tok_alice")
    assert ensure_repo("alice/shard-uploader", "tok_alice", False) is True
    assert ensure_repo("alice/shard-uploader", "tok_alice", False) is False
    root = tmp_path / "repo"
    dst = root / "transformer"
    up = ShardUploader("alice/shard-uploader", "tok_alice", root, "Int8Tensor", shard_bytes=150_000)
    up.limit = 150_000  # no overlap: while a shard ships, the writer may not add to the one that follows
    sink = up.for_component("transformer", dst)
    on_disk: list[int] = []
    bytes_on_disk: list[int] = []
    real_upload = up.upload

    def watched(path: Path) -> None:
        on_disk.append(len(list(dst.glob("*.safetensors"))))
        bytes_on_disk.append(sum(p.stat().st_blocks * 512 for p in dst.glob("*.safetensors")))
        real_upload(path)

    monkeypatch.setattr(up, "upload", watched)
    res = stream_quantize(StreamJob(tiny_flux_dir / "transformer", dst, library="diffusers", recipe=recipes.get("int8wo"),
                                    class_name="FluxTransformer2DModel", progress=False, max_shard_size="150KB"),
                          sink=sink)
    up.flush()
    index = json.loads((dst / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3
    assert sorted(up.ops) == [f"transformer/{s}" for s in shards]  # every shard pre-uploaded ...
    assert not list(dst.glob("*.safetensors"))  # ... and deleted
    assert max(on_disk) <= 3  # never more than a couple of shards waiting on disk
    # the disk budget: the shipping shard and at most one more (a tensor spanning two shards), never the next ones
    assert max(bytes_on_disk) <= 2 * 150_000 + 8192
    assert set(up.expected) == set(up.ops) and all(len(h.sha256 or "") == 64 for h in up.expected.values())
    assert up.checked["transformer"] == len(res.digests) and up.classes["transformer"] == len(res.quantized)
    assert all(op._is_uploaded for op in up.ops.values())
    assert HfApi(token="tok_alice").list_repo_files("alice/shard-uploader") == [".gitattributes"]  # no commit yet
