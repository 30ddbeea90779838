"""Benchmark: the documented library path vs the streaming engine on a FLUX-shaped transformer.

    python benchmarks/bench_streaming.py --size-gb 2.5 --recipe int8wo [--workdir DIR] [--device cuda]

Builds a checkpoint with FLUX.1-dev's transformer dimensions and fewer blocks (random bf16, three
shards, written one tensor at a time), then runs, each in a fresh subprocess: the library path
(from_pretrained + save_pretrained), the streaming engine (shards "downloaded" by copying into a
cache and deleted once read, as the CLI does), and a compute floor (read every tensor, quantize
every Linear weight on a bare nn.Linear, write the bytes; no framework). Prints wall time per
stage, peak RSS (the child's own ru_maxrss, cross-checked by sampling), peak disk (input + output
bytes present at once, sampled) and a linear projection to FLUX.1-dev (23.8 GB bf16); checks the two
outputs are the same files.

With ``--publish`` it then runs the whole publish job as a user would, in a fresh process: the real
CLI against a loopback Hub seeded with a pipeline whose transformer is that checkpoint,
``--low-disk`` (base weights read by HTTP range; each output shard checked tensor by tensor,
pre-uploaded and deleted; everything committed as a pull request, checked block by block over HTTP
range, merged; the merged commit checked again), and prints its stage times,
the peak RSS of its whole process tree and its peak disk. Figures only: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from publisher.testing.checkpoints import compare_checkpoints  # noqa: E402 - after the path insert
from publisher.testing.configs import FLUX_DEV, FLUX_DEV_BF16_BYTES, flux_dev_blocks, flux_dev_shaped  # noqa: E402

GIB = 1024 ** 3


# ------------------------------------------------------------------ checkpoint

def build_checkpoint(folder: Path, layers: int, singles: int, shards: int = 3) -> int:
    """Write config.json, the index and `shards` safetensors files, one random bf16 tensor at a time."""
    import torch
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel
    from huggingface_hub.serialization import split_state_dict_into_shards_factory

    from publisher.streaming import safetensors_io as stio

    folder.mkdir(parents=True, exist_ok=True)
    with init_empty_weights():
        model = FluxTransformer2DModel.from_config(flux_dev_shaped(layers, singles))
    model.save_config(folder)
    specs = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    sizes = {k: math.prod(s) * 2 for k, s in specs.items()}
    total = sum(sizes.values())
    split = split_state_dict_into_shards_factory(
        specs, get_storage_size=lambda s: math.prod(s) * 2, max_shard_size=math.ceil(total / shards) + 1,
        filename_pattern="diffusion_pytorch_model{suffix}.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name, keys in split.filename_to_tensors.items():
        keys = sorted(keys)  # one dtype: safetensors orders by name
        spans, off = [], 0
        for k in keys:
            spans.append((k, "BF16", specs[k], off, off + sizes[k]))
            off += sizes[k]
        with open(folder / name, "wb") as f:
            f.write(stio.encode_header({"format": "pt"}, spans))
            for k in keys:
                t = torch.randn(specs[k], generator=gen, dtype=torch.float32).mul_(0.02).to(torch.bfloat16)
                f.write(stio.tensor_bytes(t))
    index = {"metadata": {"total_size": total}, "weight_map": split.tensor_to_filename}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return total


# ------------------------------------------------------------------ children

_IMPORT_RSS = [0]


def _rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child_library(a: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    import diffusers  # noqa: F401 - import cost reported apart
    import torch
    from diffusers import FluxTransformer2DModel  # noqa: F401 - diffusers imports model modules lazily

    from publisher import recipes
    from publisher.recipes import build_config

    t_import = time.perf_counter() - t0
    _IMPORT_RSS[0] = _rss()
    recipe = recipes.get(a.recipe)
    kwargs = {"device_map": a.device} if a.device != "cpu" else {}
    t1 = time.perf_counter()
    qconf = diffusers.TorchAoConfig(build_config(recipe))
    model = diffusers.FluxTransformer2DModel.from_pretrained(Path(a.src), quantization_config=qconf,
                                                             torch_dtype=torch.bfloat16, **kwargs)
    t2 = time.perf_counter()
    model.save_pretrained(Path(a.dst))
    t3 = time.perf_counter()
    return {"stages": {"import": t_import, "load+quantize": t2 - t1, "save": t3 - t2}}


def child_stream(a: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    import diffusers  # noqa: F401 - the same imports as the other children, timed apart
    import torchao.quantization  # noqa: F401
    from diffusers import FluxTransformer2DModel  # noqa: F401 - diffusers imports model modules lazily

    from publisher import recipes
    from publisher.streaming import StreamJob, stream_quantize

    t_import = time.perf_counter() - t0
    _IMPORT_RSS[0] = _rss()
    # src_dir holds config.json and the index (as after a metadata-only download); shards are
    # "downloaded" into the cache by copying and deleted once read.
    hub, cache = Path(a.src), Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    fetch_s = [0.0]

    class Downloads:  # streaming.ShardInputs
        def open(self, name: str) -> Path:  # stands in for hf_hub_download
            t = time.perf_counter()
            path = Path(shutil.copy(hub / name, cache / name))
            fetch_s[0] += time.perf_counter() - t
            return path

        def release(self, path: Path) -> None:
            path.unlink()

    res = stream_quantize(StreamJob(hub, Path(a.dst), library="diffusers", recipe=recipes.get(a.recipe),
                                    inputs=Downloads(), progress=a.progress, device=a.device))
    stages = {"import": t_import, "fetch(copy)": fetch_s[0], **res.stage_seconds}
    return {"stages": stages, "quantized": len(res.quantized), "skipped": len(res.skipped)}


def child_floor(a: argparse.Namespace) -> dict:
    """Read every tensor, quantize Linear weights with torchao on a bare nn.Linear, write the bytes: no framework."""
    t0 = time.perf_counter()
    import diffusers  # noqa: F401 - the same imports as the other children
    import torch
    from diffusers import FluxTransformer2DModel  # noqa: F401 - diffusers imports model modules lazily
    from torchao.quantization import quantize_

    from publisher import recipes
    from publisher.recipes import build_config
    from publisher.streaming import safetensors_io as stio

    t_import = time.perf_counter() - t0
    _IMPORT_RSS[0] = _rss()
    config = build_config(recipes.get(a.recipe))
    src = Path(a.src)
    linear = set(json.loads(a.linear))
    read = quant = write = 0.0
    with open(Path(a.dst) / "floor.bin", "wb") as out:
        for shard in sorted(p for p in src.glob("*.safetensors")):
            _, header = stio.read_header(shard)
            with open(shard, "rb", buffering=0) as f:
                for entry in sorted(header.values(), key=lambda e: e.begin):
                    t = time.perf_counter()
                    w = stio.read_tensor(f, entry)
                    t1 = time.perf_counter()
                    parts = [w]
                    if entry.name in linear:
                        lin = torch.nn.Linear(1, 1, bias=False, device="meta")
                        lin.weight = torch.nn.Parameter(w.to(a.device), requires_grad=False)
                        quantize_(lin, config)
                        q = lin.weight
                        parts = [getattr(q, n).cpu() for n in q.tensor_data_names]
                    t2 = time.perf_counter()
                    for p in parts:
                        out.write(stio.tensor_bytes(p))
                    read, quant, write = read + t1 - t, quant + t2 - t1, write + time.perf_counter() - t2
                    del w, parts, p  # one tensor alive at a time, as in the engine
                    lin = q = None
    return {"stages": {"import": t_import, "read": read, "quantize": quant, "write": write}}


def run_child(kind: str, args: list[str], watch: list[Path]) -> dict:
    """Run one child; sample its RSS (psutil) and the bytes present under `watch` while it runs."""
    cmd = [sys.executable, __file__, "--child", kind, *args]
    out, _, code, wall, rss, disk = run_watched(cmd, None, watch)
    if code:
        raise SystemExit(f"{kind} child failed with exit code {code}")
    result = json.loads(out.strip().splitlines()[-1])
    result.update(wall=wall, sampled_rss=rss, peak_disk=disk)
    return result


def run_watched(cmd: list[str], env: dict | None, watch: list[Path]) -> tuple[str, str, int, float, int, int]:
    """(stdout, stderr, exit code, wall s, peak RSS of the process tree, peak bytes under `watch`), sampled every 0.1 s."""
    import psutil

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak = {"rss": 0, "disk": 0}
    done = threading.Event()

    def sample() -> None:
        root = psutil.Process(proc.pid)
        while not done.is_set():
            try:  # the whole tree: the process and any process it starts
                peak["rss"] = max(peak["rss"], sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]))
            except psutil.Error:
                pass
            peak["disk"] = max(peak["disk"], _du(*watch))
            done.wait(0.1)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, err = proc.communicate()
    done.set()
    th.join()
    if proc.returncode:
        sys.stderr.write(err[-4000:])
    return out, err, proc.returncode, time.perf_counter() - t0, peak["rss"], peak["disk"]


def _du(*paths: Path) -> int:
    """Allocated bytes (sparse files count what is written; a hard-linked file counts once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for path in paths:
        for root, _, files in os.walk(path):  # os.walk skips a folder removed while we walk (rglob raises)
            for name in files:
                try:
                    st = os.lstat(os.path.join(root, name))
                except OSError:  # removed while we walk
                    continue
                if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
        if path.is_file():
            total += path.stat().st_blocks * 512
    return total


# ------------------------------------------------------------------ the whole publish run

def _text_encoders_for(repo: Path, clip_dim: int, t5_dim: int) -> None:
    """Replace the tiny pipeline's text encoders by one-layer ones whose outputs have the widths the FLUX-shaped
    transformer takes (CLIP-L's pooled 768, T5-XXL's 4096): the publish records the pipeline's own call to the
    transformer for its forward checks, and tiny-width embeddings would not fit it."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip = CLIPTextConfig.from_pretrained(repo / "text_encoder")  # the tiny encoders' configs, only wider
    t5 = T5Config.from_pretrained(repo / "text_encoder_2")
    wide = {"text_encoder": CLIPTextModel(CLIPTextConfig(**{**clip.to_dict(), "hidden_size": clip_dim,
                                                            "intermediate_size": 2 * clip_dim, "projection_dim": clip_dim})),
            "text_encoder_2": T5EncoderModel(T5Config(**{**t5.to_dict(), "d_model": t5_dim, "d_ff": 256}))}
    for name, model in wide.items():
        shutil.rmtree(repo / name)
        model.to(torch.bfloat16).eval().save_pretrained(repo / name)


def run_publish(work: Path, ckpt: Path, recipe: str, eval_budget: str | None = None) -> dict:
    """The CLI end to end on a pipeline whose transformer is ``ckpt``, against a loopback Hub process."""
    from publisher.testing.hubserver import spawn_server
    from publisher.testing.tiny import build_tiny_flux

    repo = work / "pipeline"
    shutil.rmtree(repo, ignore_errors=True)
    build_tiny_flux(repo, latent_channels=16)  # FLUX.1-dev's: x_embedder's in_features 64
    _text_encoders_for(repo, FLUX_DEV["pooled_projection_dim"], FLUX_DEV["joint_attention_dim"])
    shutil.rmtree(repo / "transformer")
    (repo / "transformer").mkdir()
    for f in ckpt.iterdir():
        os.link(f, repo / "transformer" / f.name)  # no second copy of the checkpoint on disk
    hf_home, out = work / "hf_home", work / "publish-out"
    for d in (hf_home, out, work / "hubdata"):
        shutil.rmtree(d, ignore_errors=True)
    url, server = spawn_server(work / "hubdata", tokens={"tok_bench": "bench"}, env={"HF_HUB_DISABLE_XET": "1"})
    env = {**os.environ, "HF_ENDPOINT": url, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(hf_home), "HF_TOKEN": "tok_bench",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONPATH": str(ROOT)}
    try:
        seed = ("import sys; from huggingface_hub import HfApi; api = HfApi(); api.create_repo('bench/flux-shaped'); "
                "api.upload_folder(repo_id='bench/flux-shaped', folder_path=sys.argv[1])")
        subprocess.run([sys.executable, "-c", seed, str(repo)], env=env, check=True, capture_output=True)
        shutil.rmtree(repo)
        cmd = [sys.executable, "-m", "publisher.cli", "bench/flux-shaped", "--quant", recipe, "--low-disk",
               "--output-dir", str(out), "--repo-id", f"bench/flux-shaped-{recipe}", "--json",
               *(["--eval-budget", eval_budget] if eval_budget else [])]
        stdout, stderr, code, wall, tree_rss, disk = run_watched(cmd, env, [hf_home, out])
        if code:
            raise SystemExit(f"publish run failed ({code}): {stderr.strip().splitlines()[-1:]}")
        data = json.loads(stdout)
        return {"wall": wall, "rss_after": data["peak_rss_after_stage"], "tree_rss": tree_rss, "peak_disk": disk,
                "seconds": data["seconds"],
                "self_rss": data["peak_rss_bytes"]["process"], "children_rss": data["peak_rss_bytes"]["children"],
                "verified": data["verified"], "evaluation": data.get("evaluation"), "published_check": [r["ok"] for r in data["published_check"]],
                "out_shards": sum(1 for f in data["files"] if f["name"].startswith("transformer/") and f["name"].endswith(".safetensors")),
                "out_bytes": sum(f["size"] for f in data["files"]
                                 if f["name"].startswith("transformer/") and f["name"].endswith(".safetensors"))}
    finally:
        server.terminate()
        server.wait()


def report_publish(pub: dict) -> None:
    stages = ", ".join(f"{k} {v:.1f}s" for k, v in pub["seconds"].items())
    print("\nwhole publish run (CLI, --low-disk: range reads in execution order with the forward checks during the pass, "
          "each output shard checked, uploaded and deleted, committed as a pull request whose file hashes are checked, "
          "merged):")
    print(f"  wall {pub['wall']:.1f}s ({stages})")
    print(f"  peak RSS of the process tree {pub['tree_rss'] / GIB:.2f} GiB (CLI ru_maxrss {pub['self_rss'] / GIB:.2f} GiB, "
          f"largest child {pub['children_rss'] / GIB:.2f} GiB)")
    print(f"  peak disk (HF cache + output folder) {pub['peak_disk'] / GIB:.2f} GiB; quantized transformer "
          f"{pub['out_bytes'] / GIB:.2f} GiB in {pub['out_shards']} shard(s); base transformer weights on disk: none (HTTP range)")
    print("  CLI peak RSS after each stage: " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in pub["rss_after"].items()) + " GiB")
    print(f"  verified: {pub['verified']}, post-push check: {pub['published_check']}")
    ev = pub.get("evaluation") or {}
    if ev:  # the quality evaluation ran within the same process tree, so the peak above includes it
        print(f"  evaluation: budget {ev.get('budget_s')} s, took {ev.get('seconds')} s, grid "
              + (f"{len(ev.get('prompts') or [])} prompt(s) at {ev.get('size')} px, {ev.get('steps')} steps ({ev.get('mode')})"
                 if ev.get("image") else f"none: {ev.get('reason')}") + (f"; cut: {ev['cut']}" if ev.get("cut") else "")
              + (f"; {ev['memory_limited']}" if ev.get("memory_limited") else "")
              + f"; the grid calls' peak {ev.get('peak_rss_bytes', 0) / GIB:.2f} GiB; LPIPS "
              + (f"{max(ev['lpips']):.4f}" if ev.get("lpips") else f"not computed: {ev.get('lpips_reason')}"))
    print("  at FLUX.1-dev's size the whole run is measured, not projected: benchmarks/bench_publish.py --scale 1")


# ------------------------------------------------------------------ comparison and report

def same_output(a: Path, b: Path) -> str:
    result = compare_checkpoints(a, b)
    if result.identical:
        return "identical (tensor bytes, parsed headers, index, config)"
    return "; ".join(result.differences()[:5])


def _work(r: dict) -> float:
    """A child's wall time minus its imports and the benchmark's stand-in download (shard copies)."""
    return float(r["wall"] - r["stages"].get("import", 0) - r["stages"].get("fetch(copy)", 0))


def report(size: int, recipe: str, lib: dict, st: dict, floor: dict, verdict: str, blocks: tuple[int, int]) -> None:
    scale = FLUX_DEV_BF16_BYTES / size

    def g(x: float) -> str:
        return f"{x / GIB:6.2f}"

    def stages(r: dict) -> str:
        return ", ".join(f"{k} {v:.1f}s" for k, v in r["stages"].items())

    print(f"\nFLUX-shaped transformer: {blocks[0]} double + {blocks[1]} single blocks, {size / 1e9:.2f} GB bf16, recipe {recipe}")
    print(f"{'path':<10} {'wall s':>7} {'RSS GiB':>8} {'sampled':>8} {'imports':>8} {'disk GiB':>8}  stages")
    for name, r in (("library", lib), ("streaming", st), ("floor", floor)):
        print(f"{name:<10} {r['wall']:7.1f}   {g(r['rss'])}   {g(r['sampled_rss'])}   {g(r['import_rss'])}   {g(r['peak_disk'])}  {stages(r)}")
    print(f"\nstreaming/library peak RSS: {st['rss'] / lib['rss']:.2f}   streaming/library wall: {st['wall'] / lib['wall']:.2f}")
    print(f"streaming/floor time (excluding imports and shard copies): {_work(st) / _work(floor):.2f}")
    base = lib["import_rss"]  # what torch & co cost before any weight; the rest grows with the model
    lib_proj = base + (lib["rss"] - base) * scale
    out_ratio = st["out_bytes"] / size
    print(f"\nprojection to FLUX.1-dev ({FLUX_DEV_BF16_BYTES / 1e9:.1f} GB bf16, x{scale:.1f}; linear in bytes, same largest tensor):")
    print(f"  library:   RSS ~{lib_proj / GIB:.1f} GiB, wall ~{lib['wall'] * scale / 60:.1f} min, "
          f"disk ~{lib['peak_disk'] * scale / GIB:.1f} GiB (snapshot + output)")
    # FLUX.1-dev's largest input shard is ~10 GB; outputs are out_ratio of the input.
    print(f"  streaming: RSS ~{st['rss'] / GIB:.1f} GiB (does not grow), wall ~{st['wall'] * scale / 60:.1f} min, "
          f"disk ~{(10e9 + out_ratio * FLUX_DEV_BF16_BYTES) / GIB:.1f} GiB with shards downloaded one at a time (largest "
          f"input shard + outputs), ~{out_ratio * FLUX_DEV_BF16_BYTES / GIB:.1f} GiB with --low-disk (HTTP range: outputs only)")
    print(f"  floor:     wall ~{floor['wall'] * scale / 60:.1f} min")
    print(f"\noutputs: {verdict}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.5)
    ap.add_argument("--recipe", default="int8wo")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--keep", action="store_true", help="keep the workdir")
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--publish", action="store_true", help="also run the whole publish job (CLI, loopback Hub)")
    ap.add_argument("--publish-only", action="store_true", help="only the whole publish job (no engine comparison)")
    ap.add_argument("--eval-budget", default=None, help="the publish's --eval-budget (default: the CLI's, auto)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of the streaming engine and of the floor (fastest counts)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--src", help=argparse.SUPPRESS)
    ap.add_argument("--dst", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    ap.add_argument("--linear", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        result = {"library": child_library, "stream": child_stream, "floor": child_floor}[a.child](a)
        result.update(rss=_rss(), import_rss=_IMPORT_RSS[0])
        print(json.dumps(result))
        return

    work = a.workdir or Path(tempfile.mkdtemp(prefix="bench-streaming-"))
    work.mkdir(parents=True, exist_ok=True)
    hub, lib_out, st_out, cache, floor_out = (work / n for n in ("hub", "library", "streaming", "cache", "floor"))
    for d in (lib_out, st_out, cache, floor_out):
        shutil.rmtree(d, ignore_errors=True)
    floor_out.mkdir()
    try:
        blocks = flux_dev_blocks(a.size_gb)
        t = time.perf_counter()
        size = build_checkpoint(hub, *blocks)
        print(f"built {hub} ({size / 1e9:.2f} GB) in {time.perf_counter() - t:.0f}s", file=sys.stderr)
        if a.publish_only:
            report_publish(run_publish(work, hub, a.recipe, a.eval_budget))
            return
        common = ["--recipe", a.recipe, "--device", a.device] + (["--progress"] if a.progress else [])
        lib = run_child("library", [*common, "--src", str(hub), "--dst", str(lib_out)], [hub, lib_out])
        linear = json.dumps(_linear_weights(hub))
        # The machine's speed drifts between runs (shared cores): streaming and floor alternate, `--repeat`
        # times each, and each path's fastest run counts (the other figures are printed too).
        st_runs, floor_runs = [], []
        for _ in range(a.repeat):
            shutil.rmtree(st_out, ignore_errors=True)
            shutil.rmtree(cache, ignore_errors=True)
            st_runs.append(run_child("stream", [*common, "--src", str(hub), "--dst", str(st_out), "--cache", str(cache)],
                                     [cache, st_out]))
            floor_runs.append(run_child("floor", [*common, "--src", str(hub), "--dst", str(floor_out), "--linear", linear],
                                        [hub, floor_out]))
        st, floor = min(st_runs, key=_work), min(floor_runs, key=_work)
        print("work seconds per run (imports and shard copies excluded): streaming "
              + ", ".join(f"{_work(r):.1f}" for r in st_runs) + "; floor " + ", ".join(f"{_work(r):.1f}" for r in floor_runs))
        st["out_bytes"] = sum(p.stat().st_size for p in st_out.glob("*.safetensors"))
        report(size, a.recipe, lib, st, floor, same_output(lib_out, st_out), blocks)
        if a.publish:
            for d in (lib_out, floor_out):  # room for the publish run
                shutil.rmtree(d, ignore_errors=True)
            report_publish(run_publish(work, hub, a.recipe, a.eval_budget))
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


def _linear_weights(src: Path) -> list[str]:
    import torch
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel

    with init_empty_weights():
        m = FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(src))
    return [f"{n}.weight" for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)]


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    main()
