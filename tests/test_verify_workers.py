"""The load-path workers (publisher/verify/workers.py): one interpreter per environment and load path loads every
component in turn, and a component whose interpreter stops early runs again alone.

The interpreter here is a stand-in (a script given as the ``python`` of a --verify-env environment would be): it reads
the request file as loadpath.py does, records each start, writes canned results and, when told so by the component's
name, crashes at that component (SIGSEGV) or after its last result. Real reloads: tests/test_verify_full.py.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

# Crashes the interpreter when it meets a component named "crash" in a request of several components (a crash that
# happens whatever else the interpreter loaded: it crashes alone too when named "crash-alone"), or ends with exit
# code 3 after writing every result when one is named "exit-3".
FAKE = """#!{python}
import json, os, signal, sys
batch = json.load(open(sys.argv[2]))["requests"]
with open(os.environ["FAKE_STARTS"], "a") as f:
    f.write(json.dumps([r["subfolder"] for r in batch]) + "\\n")
for req in batch:
    if req["subfolder"] == "crash-alone" or (req["subfolder"] == "crash" and len(batch) > 1):
        sys.stderr.write("Fatal Python error: Segmentation fault\\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGSEGV)
    with open(req["result"], "w") as f:
        json.dump({{"ok": True, "path": req["path"], "component": req["subfolder"], "threads": req["threads"]}}, f)
if any(r["subfolder"] == "exit-3" for r in batch) and len(batch) > 1:
    sys.exit(3)
"""


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    script = tmp_path / "fake-python"
    script.write_text(FAKE.format(python=sys.executable))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    starts = tmp_path / "starts.jsonl"
    monkeypatch.setenv("FAKE_STARTS", str(starts))
    return str(script), starts


def _exp(name: str) -> Any:
    from publisher.handoffs.report import Expected

    return Expected(name, "diffusers", "FluxTransformer2DModel", None, None, {}, [])


def _starts(path: Path) -> list[list[str]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _run(python: str, names: list[str], tmp_path: Path) -> list[dict[str, Any]]:
    from publisher.verify.workers import run_workers

    return run_workers([_exp(n) for n in names], "manual", python, "/nowhere", None, tmp_path / "work", None, 1)


def test_one_interpreter_loads_every_component_in_turn(fake: tuple[str, Path], tmp_path: Path) -> None:
    python, starts = fake
    results = _run(python, ["text_encoder_2", "transformer"], tmp_path)
    assert [r["component"] for r in results] == ["text_encoder_2", "transformer"] and all(r["ok"] for r in results)
    assert _starts(starts) == [["text_encoder_2", "transformer"]]  # one start for both
    (request,) = (tmp_path / "work").glob("request-*.json")
    reqs = json.loads(request.read_text())["requests"]
    assert [r["path"] for r in reqs] == ["manual", "manual"] and len({r["result"] for r in reqs}) == 2


def test_a_crash_reruns_the_unfinished_components_each_alone(fake: tuple[str, Path], tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    python, starts = fake
    results = _run(python, ["text_encoder", "crash", "transformer"], tmp_path)
    assert (f"the manual-path interpreter ({python}) stopped early (interpreter {python} failed: Fatal Python error: "
            "Segmentation fault); crash, transformer again, each in an interpreter of its own") in caplog.text
    # the component before the crash kept its result; the one it crashed on and the one after ran again, alone, and
    # passed: each component's verdict is that of its own load (the warning names the early stop)
    assert [r["component"] for r in results] == ["text_encoder", "crash", "transformer"]
    assert _starts(starts) == [["text_encoder", "crash", "transformer"], ["crash"], ["transformer"]]
    assert all(r["ok"] for r in results)


def test_a_component_that_crashes_alone_is_the_one_reported(fake: tuple[str, Path], tmp_path: Path) -> None:
    python, starts = fake
    results = _run(python, ["text_encoder", "crash-alone", "transformer"], tmp_path)
    assert results[0]["ok"] and results[2]["ok"] and results[2]["component"] == "transformer"
    assert not results[1]["ok"]
    assert results[1]["error"] == f"interpreter {python} failed: Fatal Python error: Segmentation fault"
    assert _starts(starts) == [["text_encoder", "crash-alone", "transformer"], ["crash-alone"], ["transformer"]]


def test_a_failure_after_every_result_reruns_each_component_alone(fake: tuple[str, Path], tmp_path: Path) -> None:
    python, starts = fake
    results = _run(python, ["exit-3", "transformer"], tmp_path)
    assert _starts(starts) == [["exit-3", "transformer"], ["exit-3"], ["transformer"]]
    assert all(r["ok"] for r in results)  # alone, neither fails
    # one component alone: a non-zero exit is a failure even with its result written, as before batching
    from publisher.verify.workers import run_workers

    exp = _exp("x")
    script = tmp_path / "exit-1"
    script.write_text(f"#!{sys.executable}\nimport json, sys\nreq = json.load(open(sys.argv[2]))['requests'][0]\n"
                      "open(req['result'], 'w').write('{\"ok\": true}')\nsys.exit(1)\n")
    script.chmod(0o755)
    (data,) = run_workers([exp], "library", str(script), "/nowhere", None, tmp_path / "w2", None, 1)
    assert data == {"ok": False, "error": f"interpreter {script} failed: exit code 1"}


def test_an_interpreter_that_cannot_start_fails_every_component_once(tmp_path: Path, fake: tuple[str, Path]) -> None:
    _, starts = fake
    missing = str(tmp_path / "no-such-python")
    results = _run(missing, ["a", "b"], tmp_path)
    assert [r["error"] for r in results] == [f"interpreter {missing} cannot run: No such file or directory"] * 2
    assert not os.path.exists(starts)


@pytest.mark.slow
def test_the_real_worker_frees_each_component_before_the_next(tmp_path: Path) -> None:
    """publisher/loadpath.py itself, on three components of 150 MB (one plain bf16 Llama folder, three times): its
    peak memory after the third is its peak after the first, within a quarter component, so a worker that loads every
    component of a repo needs about the largest one (docs/verification.md). A frozen reference cycle of the imports
    used to keep the previous model until the next load was done (one component more)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from publisher.handoffs.report import Expected
    from publisher.verify.workers import run_workers

    config = LlamaConfig(vocab_size=256, hidden_size=768, intermediate_size=3072, num_hidden_layers=8,
                         num_attention_heads=12, num_key_value_heads=12)
    with torch.device("meta"):
        size = sum(p.numel() * 2 for p in LlamaForCausalLM(config).parameters())
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "model")
    exps = [Expected("", "transformers", "LlamaForCausalLM", None, None, {}, []) for _ in range(3)]
    results = run_workers(exps, "library", sys.executable, str(tmp_path / "model"), None, tmp_path / "work", None, 1)
    assert all(r["ok"] for r in results), results
    first, last = results[0]["peak_rss_bytes"], results[2]["peak_rss_bytes"]
    assert first > size and last - first < size / 4, (first, last, size)
