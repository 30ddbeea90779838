"""scripts/gpu_check.py: the command lines it builds, how it reads the CLI's --json outcome, its loop against a fake
CLI and (slow) the real CLI in its CPU mode; on CUDA, the real thing. And the pieces of publisher.testing it runs on
(the float8 arithmetic check, the one checkpoint comparison)."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gc() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _script(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO)


def _option(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


# ----------------------------------------------------------------------------- the plan


def test_dry_run_prints_the_cli_command_lines_for_an_h100_class_gpu():
    proc = _script("--dry-run", "--assume-cc", "9.0", "--base", "llama", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line and not line.startswith("#")]
    cmds = [shlex.split(line) for line in lines]
    hidden = "CUDA_VISIBLE_DEVICES="  # the CPU-made run: CUDA hidden from the CLI
    # every GPU recipe's reference (library) run first: a device slot that ends early has measured each once
    assert [(c[0] == hidden, _option(c, "--quant"), _option(c, "--engine")) for c in cmds] == [
        (False, "float8dq", "library"), (False, "float8dq-tensor", "library"), (False, "int4wo", "library"),
        (False, "float8dq", "streaming"), (True, "float8dq", "library"),
        (False, "float8dq-tensor", "streaming"), (True, "float8dq-tensor", "library"), (False, "int4wo", "streaming")]
    for c in cmds:
        real = c[1:] if c[0] == hidden else c
        assert real[0].endswith("hf-ao-publish") or real[1:3] == ["-m", "publisher.cli"]
        assert {"publish", "--no-push", "--json"} <= set(real)
        assert _option(real, "--compat") == "none" and _option(real, "--eval-budget") == "0"  # its own opt-outs, typed
        assert ("--benchmark" in real) == (c[0] != hidden)  # the CPU-made run measures nothing
        assert _option(real, "--output-dir").endswith(f"/{_option(real, '--quant')}/"
                                                      f"{'cpu-made' if real is not c else _option(real, '--engine')}")
    assert "# base: " in proc.stdout and "(llama)" in proc.stdout
    assert "# skipped" not in proc.stdout


def test_plan_follows_the_registry_device_rules(gc, capsys):
    assert gc.gpu_recipe_names() == ["float8dq", "float8dq-tensor", "int4wo"]
    assert gc.skip_reason("int4wo", (8, 0)) is None and gc.skip_reason("int8wo", None) is None
    assert "compute capability >= 8.9" in gc.skip_reason("float8dq", (8, 6)) and "8.6" in gc.skip_reason("float8dq", (8, 6))
    assert "no CUDA GPU" in gc.skip_reason("int4wo", None)

    assert gc.main(["--dry-run", "--assume-cc", "8.0", "--engines", "streaming"]) == 0
    out = capsys.readouterr().out
    planned = [shlex.split(line) for line in out.splitlines() if line and not line.startswith("#")]
    assert [(_option(c, "--quant"), _option(c, "--engine")) for c in planned] == [("int4wo", "streaming")]
    assert "# skipped float8dq: runs on a CUDA GPU with compute capability >= 8.9 only; this GPU has 8.0" in out
    assert "# skipped float8dq-tensor:" in out

    with pytest.raises(SystemExit):
        gc.parse_args(["--engines", "fast"])
    with pytest.raises(SystemExit):
        gc.parse_args(["--assume-cc", "9.0"])  # only with --dry-run
    assert gc.main(["--out", "unused"]) == 2  # no CUDA here, and no --allow-cpu


def test_plan_runs_pairs_each_run_with_its_reference(gc, tmp_path: Path):
    runs = gc.plan_runs(["float8dq", "int4wo"], tmp_path / "base", tmp_path / "w", (9, 0), prefix=["cli"],
                        benchmark=False, eval_budget="2m")
    assert [(r.label, r.same_as, r.env) for r in runs] == [  # the references first, then what is compared with them
        ("float8dq/library", None, {}), ("int4wo/library", None, {}), ("float8dq/streaming", "float8dq/library", {}),
        ("float8dq/cpu-made", "float8dq/library", {"CUDA_VISIBLE_DEVICES": ""}),  # fp8cpu makes float8dq; not int4wo
        ("int4wo/streaming", "int4wo/library", {})]
    assert all("--benchmark" not in r.cmd and _option(r.cmd, "--eval-budget") == "2m" for r in runs)
    assert runs[0].cmd[:4] == ["cli", "publish", str(tmp_path / "base"), "--quant"]
    # without a GPU the library run is the CPU-made one already
    assert [r.label for r in gc.plan_runs(["float8dq"], tmp_path, tmp_path, None, prefix=["cli"])] == [
        "float8dq/library", "float8dq/streaming"]


# ----------------------------------------------------------------------------- reading the CLI's outcome


def _doc(engine: str = "library", **over: Any) -> dict[str, Any]:
    """A --json publish outcome, trimmed from a real one (tiny FLUX, int8wo, --benchmark)."""
    doc = {
        "recipe": "int8wo", "verified": True, "pushed": False, "error": None,
        "components": [{"name": "transformer", "class": "FluxTransformer2DModel", "quantized_layers": 30,
                        "tensor_classes": {"Int8Tensor": 30}, "bytes_before": 2111232, "bytes_after": 1124248,
                        "engine": engine, "stage_seconds": {"read": 0.03}}],
        "verification": {"passed": True, "device": "cuda", "mode": "full", "results": [
            {"component": "transformer", "path": "library", "outcome": "pass", "ok": True},
            {"component": "transformer", "path": "manual", "outcome": "pass", "ok": True}]},
        "quality": [{"component": "transformer", "rel_error": 0.0078, "cosine": 0.99997}],
        "seconds": {"quantize": 0.24, "verify": 18.3, "benchmark": 18.1},
        "benchmark": {"device": "cuda", "rows": [{"component": "transformer",
                      "quantized": {"weights_mb": 1.1, "forward_peak_mb": 12.5, "eager_ms": 3.25, "compiled_ms": 1.5},
                      "bf16": {"weights_mb": 2.0, "forward_peak_mb": 20.0, "eager_ms": 2.0, "compiled_ms": 1.0}}]}}
    doc.update(over)
    return doc


def test_read_outcome_passes_only_a_verified_publish_by_the_asked_engine(gc, tmp_path: Path):
    run = gc.Run("int8wo/streaming", "int8wo", "streaming", ["cli"], tmp_path)
    ok = gc.read_outcome(run, json.dumps(_doc("streaming")), 0)
    assert ok["status"] == "ok" and ok["problems"] == []
    assert ok["components"] == [{"name": "transformer", "engine": "streaming", "tensor_classes": {"Int8Tensor": 30},
                                 "quantized_layers": 30, "bytes_before": 2111232, "bytes_after": 1124248}]
    assert ok["loads"] == {"transformer/library": "pass", "transformer/manual": "pass"}
    assert ok["verify_device"] == "cuda" and ok["benchmark"]["rows"][0]["quantized"]["eager_ms"] == 3.25
    assert ok["quality"] == {"transformer": {"rel_error": 0.0078, "cosine": 0.99997}}

    assert gc.read_outcome(run, json.dumps(_doc("library")), 0)["problems"] == [
        "transformer: ran the library engine, not streaming"]
    unverified = gc.read_outcome(run, json.dumps(_doc("streaming", verified=False)), 0)
    assert unverified["status"] == "failed" and unverified["problems"] == ["not verified"]
    failed = gc.read_outcome(run, json.dumps({"error": "VerifyError: manual path differs", "exit_code": 1}), 1)
    assert failed["status"] == "failed" and failed["problems"] == [
        "exit 1: VerifyError: manual path differs", "not verified", "no component quantized"]
    refused = gc.read_outcome(run, json.dumps({"error": "--engine streaming cannot quantize transformer: x; use "
                                                        "--engine auto", "exit_code": 1}), 1)
    assert refused["status"] == "not applicable" and "problems" not in refused
    garbled = gc.read_outcome(run, "Traceback (most recent call last):", 1)
    assert garbled["status"] == "failed" and garbled["problems"][0].startswith("no JSON document on stdout (exit 1)")
    assert gc.read_outcome(run, "", None)["problems"] == ["timed out"]


def test_execute_times_the_cli_samples_device_memory_and_kills_on_timeout(gc, tmp_path: Path):
    readings = iter([1000.0, 1200.0, 1800.0, 1500.0])
    run = gc.Run("x/library", "x", "library", [sys.executable, "-c", textwrap.dedent("""
        import os, sys, time
        print("stderr line", file=sys.stderr)
        time.sleep(0.5)
        print('{"seen": "%s"}' % os.environ["CUDA_VISIBLE_DEVICES"])""")], tmp_path / "o",
        env={"CUDA_VISIBLE_DEVICES": "hidden"})
    log = tmp_path / "cli.log"
    done = gc.execute(run, tmp_path, log, 30, read_memory=lambda: next(readings, None))
    assert done["rc"] == 0 and json.loads(done["stdout"]) == {"seen": "hidden"}
    assert done["gpu_baseline_mb"] == 1000.0 and done["gpu_peak_mb"] == 800.0
    assert 0.4 < done["wall_s"] < 20
    assert "===== x/library:" in log.read_text() and "stderr line" in log.read_text()

    slow = gc.Run("y/library", "y", "library", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path)
    done = gc.execute(slow, tmp_path, log, 1, read_memory=lambda: None)
    assert done["rc"] is None and done["wall_s"] < 30 and done["gpu_peak_mb"] is None


# ----------------------------------------------------------------------------- the loop, against a fake CLI

FAKE_CLI = """
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
value = lambda name: args[args.index(name) + 1]
engine, out = value("--engine"), Path(value("--output-dir"))
(out / "transformer").mkdir(parents=True)
(out / "transformer" / "config.json").write_text('{"a": 1}')
differ = engine == os.environ.get("FAKE_DIFFERS")
(out / "transformer" / "weights.bin").write_bytes(b"streamed" if differ else b"quantized")
doc = json.loads(os.environ["FAKE_DOC"])
doc["components"][0]["engine"] = engine
doc["verified"] = engine != os.environ.get("FAKE_UNVERIFIED")
print(json.dumps(doc))
"""


@pytest.fixture()
def fake_cli(gc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cli = tmp_path / "fake_cli.py"
    cli.write_text(FAKE_CLI)
    monkeypatch.setattr(gc, "cli_prefix", lambda: [sys.executable, str(cli)])
    monkeypatch.setenv("FAKE_DOC", json.dumps(_doc()))
    base = tmp_path / "base"
    base.mkdir()
    return base


def _check(gc, tmp_path: Path, base: Path) -> tuple[int, dict[str, Any], str]:
    out = tmp_path / "out"
    rc = gc.main(["--allow-cpu", "--recipes", "int8wo", "--base", str(base), "--out", str(out), "--work", str(tmp_path / "w")])
    return rc, json.loads((out / "results.json").read_text()), (out / "table.md").read_text()


def test_check_runs_each_engine_and_compares_with_the_library_folder(gc, tmp_path: Path, fake_cli: Path, capsys):
    rc, results, table = _check(gc, tmp_path, fake_cli)
    assert rc == 0, results["summary"]
    assert results["summary"] == {"ok": True, "passed": ["int8wo/library", "int8wo/streaming"], "failures": []}
    streaming = results["runs"]["int8wo/streaming"]
    assert streaming["compared"]["transformer"]["identical"] is True and streaming["same_as"] == "int8wo/library"
    assert "--engine streaming" in streaming["cmd"] and streaming["outcome"]["components"][0]["engine"] == "streaming"
    assert results["meta"]["base"] == str(fake_cli) and results["meta"]["cc"] is None and results["arith"] == {}
    rows = [line for line in table.splitlines() if line.startswith("| int8wo")]
    assert len(rows) == 2 and "| 3.25 (2.00) | 1.50 (1.00) | 12.5 (20.0) |" in rows[0]  # the CLI's benchmark block
    assert rows[1].split("|")[13].strip() == "int8wo/library: yes"
    assert table in capsys.readouterr().out and "OK: 2 runs passed" in table


def test_check_fails_when_the_engines_differ_or_a_publish_does_not_verify(gc, tmp_path: Path, fake_cli: Path,
                                                                           monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FAKE_DIFFERS", "streaming")
    rc, results, table = _check(gc, tmp_path / "a", fake_cli)
    assert rc == 1
    assert results["summary"]["failures"] == [
        "int8wo/streaming: transformer differs from int8wo/library (2 files, 0 tensors in A, 0 in B, 1 differences)"]
    assert "int8wo/library: NO" in table and "FAILED: 2 runs passed" in table

    monkeypatch.delenv("FAKE_DIFFERS")
    monkeypatch.setenv("FAKE_UNVERIFIED", "library")
    rc, results, table = _check(gc, tmp_path / "b", fake_cli)
    assert rc == 1 and results["summary"]["failures"] == ["int8wo/library: not verified"]
    assert "compared" not in results["runs"]["int8wo/streaming"]  # nothing to compare with


def test_time_budget_skips_the_runs_that_would_not_fit(gc, tmp_path: Path, fake_cli: Path):
    out = tmp_path / "out"
    rc = gc.main(["--allow-cpu", "--recipes", "int8wo", "--base", str(fake_cli), "--out", str(out), "--time-budget", "10"])
    results = json.loads((out / "results.json").read_text())
    assert rc == 1 and results["summary"]["failures"] == ["no run passed"]
    assert all(r["status"] == "skipped" and r["reason"].startswith("time budget") for r in results["runs"].values())


# ----------------------------------------------------------------------------- the real CLI


@pytest.mark.slow
def test_cpu_mode_runs_the_real_cli(tmp_path: Path):
    out = tmp_path / "out"
    proc = _script("--allow-cpu", "--recipes", "int8wo", "--engines", "streaming", "--no-benchmark", "--out", str(out),
                   "--work", str(tmp_path / "w"), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    run = results["runs"]["int8wo/streaming"]
    assert run["status"] == "ok" and run["outcome"]["verified"] is True, run
    assert run["outcome"]["components"][0]["engine"] == "streaming"
    assert run["outcome"]["components"][0]["tensor_classes"] == {"Int8Tensor": 30}
    assert run["outcome"]["loads"] == {"transformer/library": "pass", "transformer/manual": "pass"}
    assert "--engine streaming --no-push --json" in (out / "cli.log").read_text()
    assert (tmp_path / "w" / "published" / "int8wo" / "streaming" / "transformer" / "config.json").is_file()


@pytest.mark.gpu
@pytest.mark.slow
def test_on_gpu(tmp_path: Path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path / "out"
    proc = _script("--out", str(out), timeout=900)
    results = json.loads((out / "results.json").read_text())
    assert proc.returncode == 0 and results["summary"]["ok"], json.dumps(results["summary"]) + proc.stdout[-3000:]
    if tuple(results["meta"]["cc"]) >= (8, 9):
        made = results["runs"]["float8dq/cpu-made"]
        assert made["status"] == "ok" and made["compared"]["transformer"]["identical"]
        assert results["arith"]["all_identical"]


def test_arith_check_on_cpu():
    """Step 0 alone: fp8cpu and the reference agree on every torture tensor and reproduce the dev machine's hashes."""
    from publisher.testing.fp8_checks import EXPECTED_CPU_HASHES, arith_check

    res = arith_check("cpu")
    assert res["all_identical"] and res["compared_against"] == "cpu_fp8cpu"
    assert {k: v["hash_cpu_fp8cpu"] for k, v in res.items() if isinstance(v, dict)} == EXPECTED_CPU_HASHES


def _checkpoint(folder: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"a": 1, "b": [1, 2]}))
    save_file({"w": torch.arange(16, dtype=torch.bfloat16).reshape(4, 4), "b": torch.ones(4)},
              str(folder / "model.safetensors"), metadata={"format": "pt", "x": "1"})
    return folder


def _rewrite_header(shard: Path, edit) -> None:  # type: ignore[no-untyped-def]
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.dumps(edit(json.loads(raw[8:8 + n]))).encode()
    shard.write_bytes(len(header).to_bytes(8, "little") + header + raw[8 + n:])


def test_compare_checkpoints_tells_same_from_different(tmp_path: Path):
    """The one checkpoint comparison (gpu_check's CPU-made vs device-made, scripts/compare_checkpoints.py)."""
    import shutil

    from publisher.testing.checkpoints import NOT_COMPARED, SAME_JSON, SAME_TENSORS, compare_checkpoints

    a = _checkpoint(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    same = compare_checkpoints(a, b)
    assert same.identical and same.raw_bytes_identical and same.tensors == (2, 2)

    # what safetensors does between two saves: the same header, keys in another order; and reformatted JSON
    _rewrite_header(b / "model.safetensors", lambda h: dict(reversed(list(h.items()))))
    (b / "config.json").write_text(json.dumps({"b": [1, 2], "a": 1}, indent=2))
    reordered = compare_checkpoints(a, b)
    assert reordered.identical and not reordered.raw_bytes_identical
    assert reordered.files == {"config.json": SAME_JSON, "model.safetensors": SAME_TENSORS}

    raw = bytearray((b / "model.safetensors").read_bytes())
    raw[-1] ^= 0x01  # the last byte of the last tensor's data
    (b / "model.safetensors").write_bytes(bytes(raw))
    _rewrite_header(b / "model.safetensors", lambda h: {**h, "__metadata__": {"format": "pt", "x": "2"}})
    (b / "extra.txt").write_text("x")
    (b / "README.md").write_text("a card: not part of the checkpoint")
    diff = compare_checkpoints(a, b)
    assert not diff.identical
    assert diff.files == {"README.md": NOT_COMPARED, "config.json": SAME_JSON, "extra.txt": "only in B",
                          "model.safetensors": "differs"}
    changed = {d["tensor"]: d for d in diff.differing_tensors}
    assert changed["<metadata>"]["keys"] == ["x"] and changed["w"]["n_diff"] == 1 and "b" not in changed
    assert diff.summary() == "4 files, 2 tensors in A, 2 in B, 2 differences"

    script = REPO / "scripts" / "compare_checkpoints.py"
    for folder, code in ((a, 0), (b, 1), (tmp_path / "missing", 2)):
        proc = subprocess.run([sys.executable, str(script), str(a), str(folder)], capture_output=True, text=True)
        assert proc.returncode == code, proc.stdout + proc.stderr
        assert code == 2 or proc.stdout.startswith("2 files" if code == 0 else "4 files")


def test_a_fresh_device_slot_fits_the_defaults(gc):
    """A device call runs at most 600 s: the default budget leaves room for the set-up and the way back, one run's
    limit fits in it, and the shell script compiles the carried wheels' bytecode before the first run (on a fresh
    device the first CLI run compiled it: about 120 s against about 100 s for each later one, issue 38)."""
    args = gc.parse_args([])
    assert args.time_budget <= 600 - 60 and args.run_timeout < args.time_budget / 2
    script = (Path(gc.__file__).parent / "gpu_check.sh").read_text().splitlines()
    install = next(i for i, line in enumerate(script) if "pip install" in line and "--target /tmp/site" in line)
    compiled = next(i for i, line in enumerate(script) if "compileall" in line and "/tmp/site" in line)
    run = next(i for i, line in enumerate(script) if "scripts/gpu_check.py" in line and line.lstrip().startswith('"$PY"'))
    assert install < compiled < run
