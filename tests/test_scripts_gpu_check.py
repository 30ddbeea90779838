"""scripts/gpu_check.py: its CPU mode here, the real thing where CUDA is available."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.py"


def _run(out: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, str(SCRIPT), str(out), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


@pytest.mark.slow
def test_cpu_tiny_mode(tmp_path: Path):
    out = tmp_path / "out"
    proc = _run(out, "--device", "cpu", "--tiny", "--recipes", "float8dq,int8wo,int4wo", "--work",
                str(tmp_path / "work"), timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    table = (out / "table.md").read_text()

    s = results["summary"]
    assert s["ok"] and not results["failures"], results["failures"]
    assert s["arith_identical"] is True
    assert s["arith_dev_machine_hashes"] == ["True"]  # this CPU reproduces the hashes embedded in the script
    assert s["recipes_ok"] == ["float8dq", "int8wo"]
    assert "int4wo" in s["recipes_skipped"] and "CUDA" in s["recipes_skipped"]["int4wo"]
    assert s["fp8_cpu_bytes_identical"] == {"float8dq": True}

    f8 = results["recipes"]["float8dq"]
    assert f8["class_ok"] and f8["quantized"] == f8["linears"] > 0 and f8["float8_attrs"]["ok"]
    assert f8["reload_hf_identical"] and f8["reload_manual_identical"]
    assert f8["quantization_config"]["quant_type"]["default"]["_type"] == "Float8DynamicActivationFloat8WeightConfig"
    assert any(name.endswith(".index.json") for name in f8["files"])  # sharded: cross-shard reload exercised
    assert results["fp8_cpu_vs_device"]["float8dq"]["device_output_identical"]
    assert results["compile"]["note"].startswith("skipped")

    # one table, a row per recipe plus the CPU-made float8dq row
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| recipe | status")
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["bf16", "float8dq", "int8wo", "int4wo", "float8dq (CPU-made)"]
    assert "| int4wo | skipped |" in table
    assert table in proc.stdout  # the same table is printed


@pytest.mark.gpu
@pytest.mark.slow
def test_on_gpu(tmp_path: Path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path / "out"
    proc = _run(out, "--device", "cuda", "--work", str(tmp_path / "work"), timeout=900)
    results = json.loads((out / "results.json").read_text())
    s = results["summary"]
    assert proc.returncode == 0 and s["ok"], json.dumps(s) + proc.stdout[-3000:]
    cc = tuple(results["meta"]["cc"])
    if cc >= (8, 9):
        assert set(s["fp8_cpu_bytes_identical"]) == {"float8dq", "float8dq-tensor"}
        assert all(s["fp8_cpu_bytes_identical"].values())
