"""Measured figures for the card when the recipe ran on a GPU: weight memory, peak memory of a forward,
and latency against the bf16 base, eager and with torch.compile, with the GPU's name and capability.

Runs after verification, one model on the device at a time. On a CPU (tests) the memory columns are
empty and only latency is measured.
"""

from __future__ import annotations

import collections.abc
import contextlib
import gc
import logging
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from publisher.io.integrity import sha256_file
from publisher.loadpath import forward, load_call, load_component
from publisher.runtime import procs

if TYPE_CHECKING:
    from publisher.handoffs.artifacts import QuantizedComponent
    from publisher.handoffs.report import Expected

log = logging.getLogger(__name__)


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def allocated_mb(device: str, peak: bool = False) -> float | None:
    """MiB allocated by torch on the GPU now (or at the peak since ``reset_peak``); None on a CPU."""
    import torch

    if device != "cuda":
        return None
    return round((torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()) / 2**20, 1)


def reset_peak(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


@contextlib.contextmanager
def gpu_memory(device: str) -> collections.abc.Iterator[dict[str, float | None]]:
    """What the block allocates on the GPU, in MiB above its start: ``added`` (still held at its end) and
    ``peak``; both stay None on a CPU."""
    import torch

    mem: dict[str, float | None] = {"added": None, "peak": None}
    reset_peak(device)
    if device != "cuda":
        yield mem
        return
    start = torch.cuda.memory_allocated()
    yield mem
    sync(device)
    mem["added"] = round((torch.cuda.memory_allocated() - start) / 2**20, 1)
    mem["peak"] = round((torch.cuda.max_memory_allocated() - start) / 2**20, 1)


def free(device: str) -> None:
    """Collect garbage and hand cached GPU blocks back, so the next allocation figures start clean."""
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def latency_ms(model: Any, library: str, inputs: dict[str, Any], device: str, iters: int) -> float:
    """Median milliseconds of ``iters`` forward passes after one warm-up (and the compile, for a compiled model)."""
    forward(model, library, inputs)
    times = []
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        forward(model, library, inputs)
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 3)


def _measure(folder: Path, library: str, class_name: str, inputs_file: Path, device: str, iters: int, compile: bool) -> dict[str, Any]:
    import torch


    with gpu_memory(device) as mem:
        model = load_component(library, class_name, folder, device=device)
    inputs = load_call(inputs_file, device)
    reset_peak(device)
    forward(model, library, inputs)
    row: dict[str, Any] = {
        "weights_mb": mem["added"],
        "forward_peak_mb": allocated_mb(device, peak=True),
        "eager_ms": latency_ms(model, library, inputs, device, iters),
        "compiled_ms": None,
        "compile_error": None,
    }
    if compile:
        try:
            row["compiled_ms"] = latency_ms(torch.compile(model), library, inputs, device, iters)
        except (RuntimeError, AssertionError, NotImplementedError, torch._dynamo.exc.TorchDynamoException) as exc:
            # a measurement, not a publication check: record why compile did not work
            row["compile_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    del model, inputs
    free(device)
    return row


class Bf16Rows:
    """The bf16 base's rows of one run, measured once and read by every recipe: the base folder, forward inputs,
    device, iterations and compile are the run's, so a second recipe's bf16 row would measure the same thing again
    (on a GPU, most of the benchmark's time is compiling it: 63.6 s of a tiny FLUX's 100 s on an H200)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[Any, ...], tuple[dict[str, Any], str]] = {}  # key -> (row, the recipe that measured it)

    @staticmethod
    def key(request: dict[str, Any]) -> tuple[Any, ...]:
        """What decides the figure: the request, and the bytes of its inputs file (its path could be reused)."""
        return (*sorted(request.items()), sha256_file(Path(request["inputs"])))

    def get(self, request: dict[str, Any], label: str, recipe: str) -> dict[str, Any]:
        key = self.key(request)
        if key in self.rows:
            row, by = self.rows[key]
            log.info("benchmark: %s (bf16) reused: measured once this run, for %s", label, by)
            return dict(row)
        log.info("measuring %s (bf16) on %s", label, request["device"])
        row = _in_subprocess(request)
        if "error" not in row:  # a failed measurement is tried again by the next recipe
            self.rows[key] = (row, recipe)
        return dict(row)


def measure(components: list[QuantizedComponent], expected: list[Expected], folder: Path, base_dir: Path, device: str,
            iters: int = 10, compile: bool | None = None, bf16: Bf16Rows | None = None,
            recipe: str = "") -> dict[str, Any]:
    """Quantized vs bf16 base, per component that has verification inputs. Each measurement runs in
    its own process: a crash in a compiler (seen: inductor on CPU) costs a figure, not the publication.
    ``bf16``: the run's bf16 rows (measured by the first recipe that asks, ``recipe`` names it)."""
    import torch

    compile = (device == "cuda") if compile is None else compile
    bf16 = bf16 if bf16 is not None else Bf16Rows()
    inputs_by_name = {e.component: e.inputs for e in expected if e.inputs}
    out: dict[str, Any] = {"device": device, "rows": []}
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
        out["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    for comp in components:
        inputs_file = inputs_by_name.get(comp.name)
        if inputs_file is None or not Path(inputs_file).exists():
            continue
        row: dict[str, Any] = {"component": comp.label}
        for kind, root in (("quantized", folder), ("bf16", base_dir)):
            request = {"folder": str(root / comp.name if comp.name else root), "library": comp.library,
                       "class_name": comp.class_name, "inputs": str(inputs_file), "device": device,
                       "iters": iters, "compile": compile}
            if kind == "bf16":
                row[kind] = bf16.get(request, comp.label, recipe)
                continue
            log.info("measuring %s (%s) on %s", comp.label, kind, device)
            row[kind] = _in_subprocess(request)
        out["rows"].append(row)
    return out


def _in_subprocess(request: dict[str, Any]) -> dict[str, Any]:
    import json
    import subprocess
    import sys
    import tempfile


    with tempfile.TemporaryDirectory(prefix="hf-ao-bench-") as tmp:
        req = Path(tmp) / "request.json"
        req.write_text(json.dumps(request))
        try:  # its own process group, killed with it if we stop waiting (timeout, SIGINT/SIGTERM)
            proc = procs.run([sys.executable, "-m", "publisher.stages.measure", str(req)], timeout=1800)
        except subprocess.TimeoutExpired:
            return {"weights_mb": None, "forward_peak_mb": None, "eager_ms": None, "compiled_ms": None,
                    "compile_error": None, "error": "measurement process did not finish within 1800 s (stopped)"}
        result = Path(tmp) / "result.json"
        if proc.returncode == 0 and result.exists():
            return json.loads(result.read_text())
    last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    return {"weights_mb": None, "forward_peak_mb": None, "eager_ms": None, "compiled_ms": None,
            "compile_error": None, "error": f"measurement process failed (exit {proc.returncode}): {last[:200]}"}


def main(request_file: str) -> int:
    import json

    req = json.loads(Path(request_file).read_text())
    row = _measure(Path(req["folder"]), req["library"], req["class_name"], Path(req["inputs"]), req["device"],
                   int(req["iters"]), bool(req["compile"]))
    (Path(request_file).parent / "result.json").write_text(json.dumps(row))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1]))
