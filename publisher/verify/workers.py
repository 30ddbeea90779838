"""The load-path workers: publisher/loadpath.py run as a script in fresh interpreters.

One interpreter per environment and load path loads every component of the repo in turn, each freed before the next
(memory stays at about the largest component), as a user's pipeline load reads all its components in one process.
The two load paths never share an interpreter: what one leaves registered (torchao's tensor classes allowed for
``weights_only`` loading, a library's quantizer imported) could let the other pass where a user's fresh process
fails.

A worker that stops before it has written every result (a crash in a kernel, a timeout, a non-zero exit) leaves
components unfinished: each of them runs again in an interpreter of its own, so a failure is reported for the
component that caused it, and no component goes unchecked because another one crashed its interpreter.

"Fresh" is what a user's new process is: on Linux the interpreter is forked from a zygote that has made the
imports every load path makes first (torch, the libraries' model base classes: ``zygotes.LIBRARIES``; where one of
them cannot be imported, those of the libraries it loads: ``preload_for``, at once in a built environment where an
earlier run found that), in the environment of the call; the model's class, the quantizer and torchao's tensor
classes it imports itself. A load on
a GPU is never forked (CUDA cannot cross a fork): it runs in an interpreter started ahead with those imports
(``start_early``), which becomes the worker itself, or else in a new one.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from publisher import adapters, loadpath
from publisher.handoffs.report import PATHS, Expected
from publisher.runtime import zygotes
from publisher.verify import envs, memo

log = logging.getLogger(__name__)

WORKER = Path(loadpath.__file__).resolve()
WORKER_TIMEOUT_S = 3600  # per component: a worker that loads n components has n times this


def worker_env(token: str | None) -> dict[str, str]:
    """A worker's environment: ours, with the token (through the environment, never the command line)."""
    env = dict(os.environ)
    if token:
        env["HF_TOKEN"] = token
    return env


def start_early(token: str | None, device: str, mode: str, largest: int, recipes: int = 1) -> None:
    """Start the interpreters this interpreter's workers will run in, without waiting for them: their imports overlap
    the quantization. The environment and imports are those ``_spawn`` gives ``zygotes.run``; if the environment has
    changed by then, they are not used. On the CPU, the zygote the workers fork from; for a GPU load (a fresh
    interpreter: CUDA cannot cross a fork), single-use interpreters, one for each load path of each of the
    ``recipes`` verified here (verify/full.py ``check_location``: one interpreter per load path in this environment;
    the other environments' are other interpreters). Not where the verification will stream in this process
    (``mode``; ``auto`` as ``full.choose_mode`` will likely decide it from the ``largest`` component's bf16 bytes, an
    upper bound of its quantized ones: on the CPU only, a GPU recipe reloads whole)."""
    if mode == "streaming":
        return
    if device != "cpu":
        zygotes.prestart(sys.executable, worker_env(token), zygotes.LIBRARIES, count=len(PATHS) * recipes)
        return
    if mode == "auto":
        import psutil

        if largest + 2**30 > 0.8 * psutil.virtual_memory().available:
            return
    zygotes.start(sys.executable, worker_env(token), zygotes.LIBRARIES, branch_from=sys.executable)


def preload_for(libraries: Collection[str]) -> tuple[str, ...]:
    """torch, then the base-class module of each of ``libraries`` (adapters' ``base_module``): a load's own first
    imports, for an environment where a zygote of both libraries cannot start (transformers 4.57's cannot import
    diffusers at all: its huggingface_hub is too old for it), whose loads would otherwise each run in a fresh
    interpreter. One zygote of both serves every other environment's loads, whichever library they use."""
    return (*zygotes.TORCH, *(adapters.of(lib).base_module for lib in adapters.LIBRARIES if lib in libraries))


def run_workers(exps: Sequence[Expected], path: str, python: str, where: str, revision: str | None, work: Path,
                token: str | None, threads: int, tag: str = "", device: str = "cpu",
                kept: bool = False) -> list[dict[str, Any]]:
    """Load each of ``exps`` along ``path`` with ``python`` (one interpreter for all, components rerun alone if it
    stops early); returns each component's worker result, or an error record, in the order of ``exps``. ``kept``: a
    result an earlier run measured for the same question is read instead of measured again (verify/memo.py; the
    compatibility matrix only)."""
    if not exps:
        return []
    results, failure, started = _spawn(exps, path, python, where, revision, work, token, threads, tag, device, kept)
    if failure is not None and (len(exps) == 1 or not started):
        return [failure if r is None or len(exps) == 1 else r for r in results]
    if failure is not None:
        # Stopped early: the components it did not finish run again alone (when it finished them all and still
        # failed, at its exit, each runs again alone to find the one that fails).
        redo = [i for i, r in enumerate(results) if r is None] or list(range(len(exps)))
        log.warning("the %s-path interpreter (%s) stopped early (%s); %s again, each in an interpreter of its own",
                    path, python, failure["error"], ", ".join(exps[i].component or "model" for i in redo))
        for i in redo:
            results[i] = run_workers([exps[i]], path, python, where, revision, work, token, threads, tag, device, kept)[0]
    return [r if r is not None else {"ok": False, "error": "no result"} for r in results]


def _spawn(exps: Sequence[Expected], path: str, python: str, where: str, revision: str | None, work: Path,
           token: str | None, threads: int, tag: str, device: str,
           kept: bool) -> tuple[list[dict[str, Any] | None], dict[str, Any] | None, bool]:
    """One interpreter for ``exps``: the results it wrote (None where it wrote none), the failure record when it did
    not end cleanly (else None), and whether it started at all."""
    work.mkdir(parents=True, exist_ok=True)
    batch = f"{path}-{tag}-{len(list(work.glob('request-*')))}"
    requests: list[dict[str, Any]] = []
    for i, exp in enumerate(exps):
        name = f"{batch}-{i}-{exp.component or 'model'}"
        requests.append({
            "path": path,
            "library": exp.library,
            "class_name": exp.class_name,
            "location": where,
            "subfolder": exp.component or None,
            "revision": revision,
            "inputs": str(exp.inputs) if exp.inputs else None,
            "output": str(work / f"out-{name}.safetensors"),
            "result": str(work / f"result-{name}.json"),
            "threads": threads,
            "device": device,
            "dtype": exp.dtype,
        })
    keys = [memo.key(r, python, WORKER) if kept else None for r in requests]
    for r, k in zip(requests, keys):
        found = memo.read(k, r) if k else None
        if found is not None:  # as if this interpreter had written it
            Path(r["result"]).write_text(json.dumps(found))
    todo = [r for r in requests if not Path(r["result"]).exists()]
    if not todo:
        return [json.loads(Path(r["result"]).read_text()) for r in requests], None, True
    req_file = work / f"request-{batch}.json"
    req_file.write_text(json.dumps({"requests": todo}))
    env = worker_env(token)
    timeout = WORKER_TIMEOUT_S * len(exps)
    failure: dict[str, Any] | None = None
    try:  # its own process group, killed with it if we stop waiting (timeout, SIGINT/SIGTERM)
        # a GPU load is not forked (CUDA must be initialized after any fork, never before one): an interpreter
        # started ahead (start_early) or a new one
        proc = zygotes.run(python, WORKER, [str(req_file)], env=env, timeout=timeout, outputs=work / f"output-{batch}",
                           forked=device == "cpu", preload=zygotes.LIBRARIES,
                           fallback=preload_for({e.library for e in exps}), remember=envs.zygote_notes(python),
                           branch_from=sys.executable)  # a layer over this interpreter (envs.py) branches
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
            failure = {"ok": False, "error": f"interpreter {python} failed: {last[:300]}"}
    except OSError as exc:
        return [None] * len(exps), {"ok": False, "error": f"interpreter {python} cannot run: {exc.strerror or exc}"}, False
    except subprocess.TimeoutExpired:
        failure = {"ok": False, "error": f"interpreter {python} did not finish within {timeout} s (stopped)"}
    results = [json.loads(Path(r["result"]).read_text()) if Path(r["result"]).exists() else None for r in requests]
    if failure is None and any(r is None for r in results):
        failure = {"ok": False, "error": f"interpreter {python} ended without a result"}
    for r, k, data in zip(requests, keys, results):
        if k and data is not None and failure is None and r in todo:  # a clean run's results only
            memo.write(k, data)
    return results, failure, True
