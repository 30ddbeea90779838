"""Benchmark: one whole ``--low-disk`` publish of a pipeline with FLUX.1-dev's shapes, every byte counted on the wire.

    python benchmarks/bench_publish.py [--scale 1] [--recipe int8wo] [--workdir DIR] [--no-baseline] [--json]
    python benchmarks/bench_publish.py --scale 0.1 --bandwidth 60 --recipe int8wo,int8dq,float8wo --no-baseline

The base is a FLUX pipeline whose transformer has FLUX.1-dev's exact shapes (19 double and 38 single blocks, 11.9 B
parameters, 23.8 GB bf16 in three shards), whose text encoder 2 has T5-XXL's (24 layers, 9.5 GB in two shards), and
whose CLIP-L text encoder and VAE have theirs; tokenizers, scheduler and licence come from the tiny test pipeline.
Its weight files are *virtual* (publisher/testing/virtual.py): the loopback Hub (a separate process) computes their
bytes from a seed as it serves them, so no base file sits on the local disk. ``--scale`` shrinks the block and
layer counts (at least one of each) for CI.

The real CLI then publishes it with ``--low-disk`` in a fresh process, through a byte-counting proxy
(publisher/testing/proxy.py) in front of the Hub. Printed: bytes read from the base and uploaded to the target
against the base files the run needs and the output's size, the peak RSS of the CLI's process tree (sampled), the
peak disk of its HF cache, output folder and temp folder (sampled), and the stage times. Unless ``--no-baseline``,
the quantization pass alone (the streaming engine reading the same base by HTTP range through the same proxy,
writing to a local folder, nothing else) runs first in a fresh process, for the wall-time ratio.

``--bandwidth MB/s`` makes the proxy a link of that speed each way (proxy.py ``rate``), and the report adds the
network floor: (bytes in + bytes out) / bandwidth, the time those bytes take at that speed one after the other, and
wall / floor. ``--recipe`` takes what ``--quant`` takes (``int8wo,int8dq,float8wo``: one run, several recipes).
``--eval-budget`` is passed to the publish (default 0 here: the quality evaluation is CPU time, not transfer).
Figures only: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_streaming import run_watched  # noqa: E402 - the sibling benchmark's helper

from publisher.testing.configs import FLUX_DEV  # noqa: E402

GIB = 1024**3
REPO = "bench/flux-dev-shaped"
T5_XXL = dict(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, vocab_size=32128, feed_forward_proj="gated-gelu",
              relative_attention_num_buckets=32, relative_attention_max_distance=128, dense_act_fn="gelu_new",
              is_gated_act=True, layer_norm_epsilon=1e-6, tie_word_embeddings=False, dropout_rate=0.1)
CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12, vocab_size=49408,
              max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu")
FLUX_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
                layers_per_block=2, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                norm_num_groups=32, sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159,
                use_quant_conv=False, use_post_quant_conv=False)


# ------------------------------------------------------------------ the base: real shapes, virtual weights

def _shapes(model: Any) -> list[tuple[str, tuple[int, ...]]]:
    """What save_pretrained writes: parameters (tied ones once) and persistent buffers."""
    out = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    for mod_name, mod in model.named_modules():
        for n, b in mod._buffers.items():
            if b is not None and n not in mod._non_persistent_buffers_set:
                out.append((f"{mod_name}.{n}" if mod_name else n, tuple(b.shape)))
    return out


def build_layout(folder: Path, scale: float) -> dict[str, list[tuple[str, list[tuple[str, tuple[int, ...]]]]]]:
    """Write the pipeline's small files into ``folder``; return, per component folder, its weight files and their
    tensors (file name -> [(tensor, shape)]), sharded as the libraries shard them."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from huggingface_hub.serialization import split_state_dict_into_shards_factory
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from publisher.testing.tiny import build_tiny_flux

    build_tiny_flux(folder)
    layers, singles, t5_layers = (max(1, round(n * scale)) for n in (19, 38, 24))
    with init_empty_weights():
        transformer = FluxTransformer2DModel(**{**FLUX_DEV, "num_layers": layers, "num_single_layers": singles})
        t5 = T5EncoderModel(T5Config(**{**T5_XXL, "num_layers": t5_layers}))
        clip = CLIPTextModel(CLIPTextConfig(**CLIP_L))
        vae = AutoencoderKL(**FLUX_VAE)
    comps = {"transformer": (transformer, "diffusion_pytorch_model{suffix}.safetensors", 10e9),
             "text_encoder_2": (t5, "model{suffix}.safetensors", 5e9),
             "text_encoder": (clip, "model{suffix}.safetensors", 5e9),
             "vae": (vae, "diffusion_pytorch_model{suffix}.safetensors", 10e9)}
    layout = {}
    for name, (model, pattern, shard) in comps.items():
        sub = folder / name
        for p in sub.glob("*.safetensors*"):
            p.unlink()
        if hasattr(model, "save_config"):
            model.save_config(sub)
        else:
            model.config.architectures = [type(model).__name__]
            model.config.dtype = "bfloat16"
            model.config.save_pretrained(sub)
        shapes = dict(_shapes(model))
        total = sum(math.prod(s) * 2 for s in shapes.values())
        if scale < 0.5 and name == "transformer":  # keep three input shards, as FLUX.1-dev has
            shard = math.ceil(total / 3) + 1
        split = split_state_dict_into_shards_factory(shapes, get_storage_size=lambda s: math.prod(s) * 2,
                                                     filename_pattern=pattern, max_shard_size=int(shard))
        if split.is_sharded:
            index = {"metadata": {"total_size": total}, "weight_map": split.tensor_to_filename}
            (sub / pattern.format(suffix="").replace(".safetensors", ".safetensors.index.json")).write_text(
                json.dumps(index, indent=2, sort_keys=True) + "\n")
        layout[name] = [(f, [(k, shapes[k]) for k in keys]) for f, keys in split.filename_to_tensors.items()]
    for p in folder.glob("*.safetensors"):  # the tiny pipeline's root single-file checkpoint
        p.unlink()
    return layout


def virtual_files(layout: dict, cache: Path, noise: bool = False) -> dict[str, dict[str, Any]]:
    """The admin request's files: every weight file as a virtual file with its sha256 (computed once, cached).
    ``noise``: data that never repeats (the Xet path deduplicates a repeated pattern; virtual.py)."""
    from publisher.testing.virtual import safetensors_file

    known = json.loads(cache.read_text()) if cache.is_file() else {}
    files = {}
    for seed, (name, path, tensors) in enumerate((n, f, t) for n, entries in layout.items() for f, t in entries):
        vf = safetensors_file(tensors, seed, noise=noise)
        key = f"{seed}:{vf.size}:{hashlib.sha1(vf.header).hexdigest()}" + (":noise" if noise else "")
        if key not in known:
            t0 = time.perf_counter()
            known[key] = vf.sha256()
            print(f"  sha256 of {name}/{path} ({vf.size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
            cache.write_text(json.dumps(known))
        files[f"{name}/{path}"] = {**vf.to_json(), "sha256": known[key]}
    return files


# ------------------------------------------------------------------ the runs

def _classify(method: str, path: str) -> str:
    path = path.split("?")[0].removeprefix("/_bridge")  # the storage bridge repeats the resolve path after /_bridge
    if method == "GET" and path.startswith(f"/{REPO}/resolve/"):
        return "base read"
    if method == "PUT" and path.startswith("/_lfs/"):
        return "LFS upload"
    if method == "POST" and "/commit/" in path:
        return "commit"
    return "other"


def child_baseline(a: argparse.Namespace) -> dict:
    """The quantization pass alone: the streaming engine over HTTP range, writing a local folder."""
    t0 = time.perf_counter()
    from publisher import recipes
    from publisher.streaming import StreamJob, stream_quantize
    from publisher.streaming.shards import HubShards

    t_import = time.perf_counter() - t0
    from huggingface_hub import HfApi, snapshot_download

    sha = HfApi().model_info(REPO).sha
    src = Path(snapshot_download(REPO, revision=sha, allow_patterns=["transformer/*.json"])) / "transformer"
    shards = HubShards(REPO, sha, "transformer")
    t1 = time.perf_counter()
    result = stream_quantize(StreamJob(src, Path(a.dst), library="diffusers", recipe=recipes.get(a.recipe), inputs=shards,
                                       progress=False))
    return {"import": t_import, "quantize_pass": time.perf_counter() - t1, "stage_seconds": result.stage_seconds}


def _cpu(server_pid: int) -> dict[str, float]:
    """CPU seconds so far (user + system) of the Hub server process, of this process (the proxy's threads and the
    samplers) and of the children this process waited for (the runs under test, with their whole process tree)."""
    import resource

    import psutil

    def total(t: Any) -> float:
        return float(t.user + t.system)

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"hub": total(psutil.Process(server_pid).cpu_times()), "proxy": total(psutil.Process().cpu_times()),
            "run": children.ru_utime + children.ru_stime}


def _cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(after[k] - before[k], 1) for k in before}


def run(work: Path, scale: float, recipe: str, baseline: bool, bandwidth: float | None = None,
        eval_budget: str = "0") -> dict[str, Any]:
    from huggingface_hub import HfApi

    from publisher.testing.hubserver import spawn_server
    from publisher.testing.proxy import CountingProxy, Link

    for d in ("hubdata", "hf_home", "out", "tmp", "pipeline", "baseline-out"):
        shutil.rmtree(work / d, ignore_errors=True)
    t0 = time.perf_counter()
    layout = build_layout(work / "pipeline", scale)
    files = virtual_files(layout, work / "virtual-sha256.json")
    setup_s = time.perf_counter() - t0
    # --discard-lfs: the Hub checks every upload's size and sha256 and drops its bytes. On a real runner the Hub's
    # storage is not the runner's disk; here it would be, and its writes (the output again, 22 GB at full size)
    # would compete with the run's own on a disk that sustains about 130 MB/s (dd with fdatasync).
    # The Hub serves LFS files through a second origin (its storage bridge, as huggingface.co redirects to its CDN):
    # a second proxy in front of it, on the same link, so base reads and Hub-to-Hub copies are counted (and paced) too.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        bridge_port = s.getsockname()[1]
    link = Link(bandwidth * 1e6 if bandwidth else None)
    bridge_proxy = CountingProxy(f"http://127.0.0.1:{bridge_port}", _classify, link=link).start()
    url, server = spawn_server(work / "hubdata", tokens={"tok_bench": "bench"}, env={"HF_HUB_DISABLE_XET": "1"},
                               discard_lfs=True, bridge_port=bridge_port, bridge_url=bridge_proxy.url)
    proxy = CountingProxy(url, _classify, link=link).start()
    env = {**os.environ, "HF_ENDPOINT": proxy.url, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(work / "hf_home"),
           "HF_TOKEN": "tok_bench", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONPATH": str(ROOT),
           "TMPDIR": str(work / "tmp")}
    (work / "tmp").mkdir()
    try:
        os.environ.update({"HF_ENDPOINT": url, "HF_HUB_DISABLE_XET": "1"})
        api = HfApi(endpoint=url, token="tok_bench")
        api.create_repo(REPO)
        api.upload_folder(repo_id=REPO, folder_path=work / "pipeline")
        req = urllib.request.Request(f"{url}/_admin/virtual", data=json.dumps({"repo_id": REPO, "files": files}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=600).read()
        info = api.model_info(REPO, files_metadata=True)
        base_bytes = sum(int(s.size or 0) for s in info.siblings or [] if s.rfilename != "README.md")
        transformer_bytes = sum(int(s.size or 0) for s in info.siblings or []
                                if s.rfilename.startswith("transformer/") and s.rfilename.endswith(".safetensors"))
        result: dict[str, Any] = {"scale": scale, "recipe": recipe, "setup_s": setup_s, "base_bytes": base_bytes,
                                  "transformer_bytes": transformer_bytes, "bandwidth": bandwidth}
        if baseline:
            proxy.reset()
            bridge_proxy.reset()
            cmd = [sys.executable, __file__, "--child", "baseline", "--recipe", recipe, "--dst", str(work / "baseline-out")]
            cpu0 = _cpu(server.pid)
            out, _, code, wall, rss, _ = run_watched(cmd, env, [])
            cpu = _cpu_delta(cpu0, _cpu(server.pid))
            if code:
                raise SystemExit(f"the baseline failed ({code})")
            read = _merged(proxy.totals(), bridge_proxy.totals())
            result["baseline"] = {**json.loads(out.strip().splitlines()[-1]), "wall": wall, "rss": rss, "cpu": cpu,
                                  "read": sum(v[2] for k, v in read.items() if k[1] == "base read")}
            shutil.rmtree(work / "baseline-out", ignore_errors=True)
            shutil.rmtree(work / "hf_home", ignore_errors=True)
        proxy.reset()
        bridge_proxy.reset()
        several = "," in recipe
        cmd = [sys.executable, "-m", "publisher.cli", REPO, "--quant", recipe, "--low-disk",
               "--repo-id", f"{REPO}-{{recipe}}" if several else f"{REPO}-{recipe}", "--output-dir", str(work / "out"),
               "--json", "--eval-budget", eval_budget]
        cpu0 = _cpu(server.pid)
        stdout, stderr, code, wall, tree_rss, disk = run_watched(cmd, env, [work / "hf_home", work / "out", work / "tmp"])
        cpu = _cpu_delta(cpu0, _cpu(server.pid))
        if code:
            raise SystemExit(f"the publish run failed ({code}): {stderr.strip().splitlines()[-3:]}")
        payload = json.loads(stdout)
        runs = payload["results"] if "results" in payload else [payload]  # several recipes: one result each
        data = runs[0]
        totals = _merged(proxy.totals(), bridge_proxy.totals())
        files = [f for r in runs for f in r["files"]]
        output_bytes = sum(f["size"] for f in files)
        shards = [f["size"] for f in files if f["name"].startswith("transformer/") and f["name"].endswith(".safetensors")]
        seconds: dict[str, float] = {}
        for r in runs:
            for k, v in r["seconds"].items():
                seconds[k] = seconds.get(k, 0.0) + v
        result.update(
            wall=wall, cpu=cpu, tree_rss=tree_rss, peak_disk=disk, seconds=seconds, verified=all(r["verified"] for r in runs),
            published_check=[(c["path"], c["ok"]) for r in runs for c in r["published_check"]], recipes=len(runs),
            components=[{k: c[k] for k in ("name", "bytes_before", "bytes_after", "stage_seconds")}
                        for r in runs for c in r["components"]],
            quality=[q for r in runs for q in r["quality"]], output_bytes=output_bytes, largest_output_shard=max(shards),
            output_shards=len(shards), copied=[c for r in runs for c in r["copied_from_base"]],
            self_rss=data["peak_rss_bytes"]["process"],
            read=sum(v[2] for k, v in totals.items() if k[1] == "base read"),
            uploaded=sum(v[1] for k, v in totals.items() if k[1] in ("LFS upload", "commit")),
            traffic={f"{m} {k}": v for (m, k), v in sorted(totals.items())},
        )
        return result
    finally:
        proxy.stop()
        bridge_proxy.stop()
        server.terminate()
        server.wait()


def _merged(*totals: dict[tuple[str, str], list[int]]) -> dict[tuple[str, str], list[int]]:
    out: dict[tuple[str, str], list[int]] = {}
    for table in totals:
        for key, row in table.items():
            out[key] = [a + b for a, b in zip(out.get(key, [0, 0, 0]), row)]
    return out


def report(r: dict[str, Any]) -> None:
    def gb(n: float) -> str:
        return f"{n / 1e9:.2f} GB"

    print(f"\nwhole --low-disk publish, FLUX.1-dev shapes x{r['scale']} (transformer {gb(r['transformer_bytes'])}, "
          f"base files the run needs {gb(r['base_bytes'])}), recipe {r['recipe']}")
    print(f"  bytes read from the base   {gb(r['read'])} = {r['read'] / r['base_bytes']:.3f}x the base files the run needs")
    print(f"  bytes uploaded             {gb(r['uploaded'])} = {r['uploaded'] / r['output_bytes']:.3f}x the output "
          f"({gb(r['output_bytes'])}, transformer in {r['output_shards']} shards of at most {gb(r['largest_output_shard'])})")
    print(f"  peak disk (HF cache + output folder + temp) {r['peak_disk'] / GIB:.2f} GiB = largest output shard "
          f"{r['largest_output_shard'] / GIB:.2f} GiB + {(r['peak_disk'] - r['largest_output_shard']) / GIB:.2f} GiB")
    print(f"  peak RSS of the CLI's process tree {r['tree_rss'] / GIB:.2f} GiB (its own ru_maxrss {r['self_rss'] / GIB:.2f} GiB)")
    stages = ", ".join(f"{k} {v:.1f}s" for k, v in r["seconds"].items())
    print(f"  wall {r['wall']:.1f}s ({stages}{', summed over the recipes' if r.get('recipes', 1) > 1 else ''})")
    if r.get("bandwidth"):
        rate = r["bandwidth"] * 1e6
        floor = (r["read"] + r["uploaded"]) / rate
        print(f"  link {r['bandwidth']:g} MB/s each way: network floor (bytes in + bytes out) / bandwidth = "
              f"({gb(r['read'])} + {gb(r['uploaded'])}) / {r['bandwidth']:g} MB/s = {floor:.1f}s; wall / floor = "
              f"{r['wall'] / floor:.2f} (with both directions at once the floor would be "
              f"{max(r['read'], r['uploaded']) / rate:.1f}s)")
    print("  CPU seconds (user + system, 2 cores = 2 CPU s per wall s): " + _cpu_line(r["cpu"], r["wall"]))
    for c in r["components"]:
        print(f"  {c['name']}: " + ", ".join(f"{k} {v:.1f}s" for k, v in c["stage_seconds"].items()))
    if "baseline" in r:
        b = r["baseline"]
        print(f"  quantization pass alone (same base, same proxy, fresh process): {b['quantize_pass']:.1f}s "
              f"(+ imports {b['import']:.1f}s, wall {b['wall']:.1f}s); publish wall / pass = {r['wall'] / b['wall']:.2f}")
        print("  the pass alone's CPU seconds: " + _cpu_line(b["cpu"], b["wall"]))
        print("  the pass alone's stages: " + ", ".join(f"{k} {v:.1f}s" for k, v in b["stage_seconds"].items()))
        print(f"  CPU seconds publish / pass = {sum(r['cpu'].values()) / sum(b['cpu'].values()):.2f}")
    moved = sum(c["transferred"] for c in r["copied"])
    print(f"  unchanged files copied Hub to Hub: {len(r['copied'])}, {gb(moved)} streamed through this machine")
    print(f"  verified {r['verified']}, after the push: {r['published_check']}, quality {r['quality']}")
    print("  traffic (requests, bytes up, bytes down): " + "; ".join(f"{k} {v}" for k, v in r["traffic"].items()))


def _cpu_line(cpu: dict[str, float], wall: float) -> str:
    names = {"run": "the run's process tree", "hub": "loopback Hub", "proxy": "counting proxy (and samplers)"}
    total = sum(cpu.values())
    return ", ".join(f"{names[k]} {v:.0f}" for k, v in cpu.items()) + f"; total {total:.0f} = {total / wall:.2f} cores busy"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of FLUX.1-dev's blocks and T5-XXL's layers (min 1)")
    ap.add_argument("--recipe", default="int8wo")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--no-baseline", action="store_true", help="skip the quantization-pass-alone run")
    ap.add_argument("--bandwidth", type=float, default=None, help="MB/s each way through the proxy (default: unlimited)")
    ap.add_argument("--eval-budget", default="0", help="the publish's --eval-budget (default 0: transfers, not figures)")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object on stdout")
    ap.add_argument("--keep", action="store_true", help="keep the workdir")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--dst", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child_baseline(a)))
        return
    if "," in a.recipe and not a.no_baseline:
        raise SystemExit("the quantization-pass-alone baseline runs one recipe; add --no-baseline with several")
    work = a.workdir or Path(tempfile.mkdtemp(prefix="bench-publish-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        result = run(work, a.scale, a.recipe, not a.no_baseline, a.bandwidth, a.eval_budget)
    finally:
        if not a.keep:  # the sha256 cache of the virtual files stays in a --workdir, for the next run
            for d in ("hubdata", "hf_home", "out", "tmp", "pipeline", "baseline-out"):
                shutil.rmtree(work / d, ignore_errors=True)
            if a.workdir is None:
                shutil.rmtree(work, ignore_errors=True)
    if a.json:
        print(json.dumps(result))
    else:
        report(result)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    # The HTTP path: the counting proxy sees HTTP bytes only (Xet transfers go to hf_xet's CAS, not through it); the
    # Xet path is measured by benchmarks/bench_xet.py. Read when huggingface_hub is imported.
    os.environ["HF_HUB_DISABLE_XET"] = "1"
    main()
