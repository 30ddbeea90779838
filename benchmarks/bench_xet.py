"""Benchmark: memory on the Xet path, which huggingface_hub takes by default for every Xet-backed file.

    python benchmarks/bench_xet.py [--file-gib 2] [--scale 0.125] [--workdir DIR] [--skip-publish] [--json]

The loopback Hub runs in its own process with Xet on (hf_xet's file-based CAS, publisher/testing/hubserver/xet.py).
Its base files are virtual (publisher/testing/virtual.py), of non-repeating data (a repeated pattern is what Xet's
chunking deduplicates, which would make every figure look better than a real checkpoint's), and uploaded once into
its Xet store, so a download
takes the path users take on huggingface.co: ``resolve/`` answers with ``X-Xet-Hash``, huggingface_hub asks for a
read token and hf_xet reassembles the file from the CAS into the cache's shared blob store.

1. **One file**, ``--file-gib`` GiB, each transfer in a fresh process, peak RSS from the kernel (ru_maxrss):
   a download through hf_xet with its own defaults, the same with the bound the CLI sets (publisher.io.xetupload
   MEMORY_BOUND), the same file over plain HTTP (``HF_HUB_DISABLE_XET=1``, through the storage bridge), and an
   upload of a file of that size through hf_xet.
2. **A publish** (unless ``--skip-publish``): the FLUX-shaped pipeline of benchmarks/bench_publish.py at ``--scale``
   (its weights several GB), published by the real CLI with its defaults (no ``--low-disk``: every base file
   is downloaded through Xet, then quantized by the streaming engine) and ``--no-push``; peak RSS of the process
   tree (sampled every 0.1 s), peak disk of its HF cache and output, wall.
Figures only: nothing here asserts a time or a size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_publish import build_layout, virtual_files  # noqa: E402 - the sibling benchmark's base
from bench_streaming import run_watched  # noqa: E402

GIB = 1024**3
DIRS = ("hubdata", "hf_home", "out", "tmp", "pipeline")
DOWNLOAD = ("from huggingface_hub import hf_hub_download; import resource, time; t = time.perf_counter(); "
            "hf_hub_download({repo!r}, {name!r}); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter() - t)")
UPLOAD = ("from huggingface_hub import HfApi; import resource, time; t = time.perf_counter(); "
          "HfApi().upload_file(path_or_fileobj={path!r}, path_in_repo='up.bin', repo_id={repo!r}); "
          "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter() - t)")


def _admin(url: str, path: str, body: dict[str, Any]) -> None:
    req = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=7200).read()


def _env(url: str, home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_XET_") and k != "HF_HUB_DISABLE_XET"}
    env.update(HF_ENDPOINT=url, HF_HOME=str(home), HF_TOKEN="tok_bench", HF_HUB_DISABLE_PROGRESS_BARS="1",
               HF_HUB_DISABLE_TELEMETRY="1", PYTHONPATH=str(ROOT), **extra)
    return env


def _child(code: str, env: dict[str, str]) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"the transfer failed: {proc.stderr[-2000:]}")
    kib, seconds = proc.stdout.split()
    return {"peak_rss": int(kib) * 1024, "seconds": float(seconds)}


def one_file(work: Path, url: str, gib: float) -> dict[str, Any]:
    from huggingface_hub import HfApi

    from publisher.io.xetupload import MEMORY_BOUND
    from publisher.testing.virtual import safetensors_file

    rows = int(gib * GIB) // (2 * 4096)
    vf = safetensors_file([("w", (rows, 4096))], seed=11, noise=True)  # non-repeating: nothing for Xet to dedup
    t0 = time.perf_counter()
    sha = vf.sha256()
    api = HfApi(endpoint=url, token="tok_bench")
    api.create_repo("bench/one-file")
    _admin(url, "/_admin/virtual", {"repo_id": "bench/one-file", "xet": True,
                                    "files": {"w.safetensors": {**vf.to_json(), "sha256": sha}}})
    print(f"  {vf.size / GIB:.2f} GiB file hashed and put into the Hub's Xet store in {time.perf_counter() - t0:.0f}s",
          file=sys.stderr)
    code = DOWNLOAD.format(repo="bench/one-file", name="w.safetensors")
    out: dict[str, Any] = {"file_bytes": vf.size}
    for label, extra in (("xet_defaults", {}), ("xet_bounded", MEMORY_BOUND), ("http", {"HF_HUB_DISABLE_XET": "1"})):
        home = work / f"home-{label}"
        out[label] = _child(code, _env(url, home, **extra))
        shutil.rmtree(home, ignore_errors=True)
    src = work / "upload.bin"
    with open(src, "wb") as fh:
        for chunk in vf.read(0, vf.size - 1):
            fh.write(chunk)
    api.create_repo("bench/upload")
    out["xet_upload"] = _child(UPLOAD.format(path=str(src), repo="bench/upload"),
                               _env(url, work / "home-up", **MEMORY_BOUND))
    src.unlink()
    return out


def publish(work: Path, url: str, scale: float) -> dict[str, Any]:
    from huggingface_hub import HfApi

    repo = "bench/flux-shaped-xet"
    layout = build_layout(work / "pipeline", scale)
    files = virtual_files(layout, work / "virtual-sha256.json", noise=True)
    api = HfApi(endpoint=url, token="tok_bench")
    api.create_repo(repo)
    api.upload_folder(repo_id=repo, folder_path=work / "pipeline")
    t0 = time.perf_counter()
    _admin(url, "/_admin/virtual", {"repo_id": repo, "files": files, "xet": True})
    print(f"  base weights put into the Hub's Xet store in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    info = api.model_info(repo, files_metadata=True)
    base = sum(int(s.size or 0) for s in info.siblings or [])
    out: dict[str, Any] = {"base_bytes": base}
    for mode, extra in (("xet", {}), ("http", {"HF_HUB_DISABLE_XET": "1"})):
        for d in ("hf_home", "out", "tmp"):
            shutil.rmtree(work / d, ignore_errors=True)
        (work / "tmp").mkdir()
        env = _env(url, work / "hf_home", TMPDIR=str(work / "tmp"), **extra)
        cmd = [sys.executable, "-m", "publisher.cli", repo, "--quant", "int8wo", "--no-push", "--compat", "none",
               "--output-dir", str(work / "out"), "--json"]
        stdout, stderr, code, wall, rss, disk = run_watched(cmd, env, [work / "hf_home", work / "out", work / "tmp"])
        if code:
            raise SystemExit(f"the publish ({mode}) failed ({code}): {stderr.strip().splitlines()[-3:]}")
        data = json.loads(stdout)
        out[mode] = {"wall": wall, "tree_rss": rss, "peak_disk": disk, "seconds": data["seconds"],
                     "verified": data["verified"], "rss_after": data["peak_rss_after_stage"]}
    return out


def report(r: dict[str, Any]) -> None:
    f = r["file"]
    print(f"\none {f['file_bytes'] / GIB:.2f} GiB file, fresh process each (ru_maxrss):")
    for key, label in (("xet_defaults", "download through hf_xet, its defaults"),
                       ("xet_bounded", "download through hf_xet, the CLI's bound"),
                       ("http", "download over plain HTTP (HF_HUB_DISABLE_XET=1)"),
                       ("xet_upload", "upload through hf_xet, the CLI's bound")):
        print(f"  {label:<50} peak RSS {f[key]['peak_rss'] / GIB:.2f} GiB, {f[key]['seconds']:.1f} s")
    if "publish" in r:
        p = r["publish"]
        print(f"\npublish of the FLUX-shaped pipeline x{r['scale']} ({p['base_bytes'] / 1e9:.2f} GB of base files, all "
              "downloaded), defaults, --no-push, each in a fresh process:")
        for mode, label in (("xet", "through Xet (the default)"), ("http", "over HTTP (HF_HUB_DISABLE_XET=1)")):
            m = p[mode]
            after = ", ".join(f"{k} {v / GIB:.2f}" for k, v in m["rss_after"].items())
            print(f"  {label}: peak RSS of the process tree {m['tree_rss'] / GIB:.2f} GiB; the CLI's own peak RSS after "
                  f"each stage (GiB): {after}; peak disk {m['peak_disk'] / GIB:.2f} GiB; wall {m['wall']:.0f} s; "
                  f"verified {m['verified']}")
            print("    stages: " + ", ".join(f"{k} {v:.1f}s" for k, v in m["seconds"].items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file-gib", type=float, default=2.0)
    ap.add_argument("--scale", type=float, default=0.125, help="fraction of FLUX.1-dev's blocks for the publish")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--skip-publish", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from publisher.testing.hubserver import spawn_server

    work = a.workdir or Path(tempfile.mkdtemp(prefix="bench-xet-"))
    work.mkdir(parents=True, exist_ok=True)
    for old in [*DIRS, *work.glob("home-*")]:  # a --workdir keeps only the virtual files' sha256 cache
        shutil.rmtree(work / old, ignore_errors=True)
    url, server = spawn_server(work / "hubdata", tokens={"tok_bench": "bench"}, timeout=120)
    try:
        result: dict[str, Any] = {"scale": a.scale, "file": one_file(work, url, a.file_gib)}
        if not a.skip_publish:
            result["publish"] = publish(work, url, a.scale)
    finally:
        server.terminate()
        server.wait()
        for old in [*DIRS, *work.glob("home-*")]:
            shutil.rmtree(work / old, ignore_errors=True)
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    if a.json:
        print(json.dumps(result))
    else:
        report(result)


if __name__ == "__main__":
    main()
