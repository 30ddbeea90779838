"""scripts/gpu_check.py: its CPU mode here, the real thing where CUDA is available; and the pieces of
publisher.testing it runs on (the float8 arithmetic check, the one checkpoint comparison)."""

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
    assert s["arith_dev_machine_hashes"] == ["True"]  # this CPU reproduces the hashes in publisher.testing.fp8_checks
    assert s["recipes_ok"] == ["float8dq", "int8wo"]
    assert "int4wo" in s["recipes_skipped"] and "CUDA" in s["recipes_skipped"]["int4wo"]
    assert s["fp8_cpu_bytes_identical"] == {"float8dq": True}

    f8 = results["recipes"]["float8dq"]
    assert f8["class_ok"] and f8["quantized"] == f8["linears"] > 0 and f8["float8_attrs"]["ok"]
    assert f8["reload_hf_identical"] and f8["reload_manual_identical"]  # publisher.loadpath's two paths
    assert f8["reload_hf_classes_ok"] and f8["reload_manual_classes_ok"]
    assert f8["quantization_config"]["quant_type"]["default"]["_type"] == "Float8DynamicActivationFloat8WeightConfig"
    assert any(name.endswith(".index.json") for name in f8["files"])  # sharded: cross-shard reload exercised
    cpu_made = results["fp8_cpu_vs_device"]["float8dq"]
    assert cpu_made["device_output_identical"] and cpu_made["differing_tensors"] == []
    assert set(cpu_made["files"]) == set(f8["files"])  # compared file by file
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
