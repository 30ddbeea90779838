"""The one comparison of two saved model folders, file by file and tensor by tensor.

Used by ``scripts/compare_checkpoints.py`` (its command line), ``scripts/gpu_check.py`` (CPU-made vs
GPU-made FP8) and ``benchmarks/bench_streaming.py`` (library path vs streaming engine).

A safetensors shard counts as the same when its parsed header (dtypes, shapes, offsets, ``__metadata__``)
and its data bytes are equal: safetensors writes ``__metadata__`` in hash-map order, random per save, so two
saves of one torchao model are rarely byte-identical files. A JSON file counts as the same when it parses
equal; any other file must be byte-identical. The card and the tool's record of its run (``NOT_CHECKPOINT``)
are not compared: they name the engine, the times and the paths. Files are read in chunks (shards may be
gigabytes); torch is imported only to describe a tensor that differs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

IDENTICAL = "identical bytes"
SAME_JSON = "same JSON, different bytes"
SAME_TENSORS = "same header and tensors, header bytes differ"
NOT_COMPARED = "not compared (not part of the checkpoint)"
NOT_CHECKPOINT = ("README.md", "verification.json")
_SAME = (IDENTICAL, SAME_JSON, SAME_TENSORS, NOT_COMPARED)
MAX_DETAILS = 50
_CHUNK = 64 << 20


@dataclass
class Comparison:
    """``files``: each relative path (in either folder) -> a verdict; ``tensors``: how many each side holds;
    ``differing_tensors``: what differs inside differing shards (the first ``MAX_DETAILS``)."""

    files: dict[str, str] = field(default_factory=dict)
    tensors: tuple[int, int] = (0, 0)
    differing_tensors: list[dict[str, Any]] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return all(v in _SAME for v in self.files.values())

    @property
    def raw_bytes_identical(self) -> bool:
        return all(v in (IDENTICAL, NOT_COMPARED) for v in self.files.values())

    def differences(self) -> list[str]:
        lines = [f"{name}: {v}" for name, v in self.files.items() if v not in _SAME]
        for d in self.differing_tensors:
            detail = ", ".join(f"{k} {v}" for k, v in d.items() if k not in ("file", "tensor"))
            lines.append(f"  {d['file']}: {d['tensor']}: {detail}")
        return lines

    def summary(self) -> str:
        n = sum(v not in _SAME for v in self.files.values())
        return f"{len(self.files)} files, {self.tensors[0]} tensors in A, {self.tensors[1]} in B, {n} differences"


def compare_checkpoints(a: Path, b: Path) -> Comparison:
    """Compare every file under folder ``a`` with the file at the same relative path under ``b``."""
    a, b = Path(a), Path(b)
    for folder in (a, b):
        if not folder.is_dir():
            raise NotADirectoryError(f"{folder} is not a folder")
    names = sorted({p.relative_to(root).as_posix() for root in (a, b) for p in root.rglob("*") if p.is_file()})
    result = Comparison()
    counts = [0, 0]
    for name in names:
        fa, fb = a / name, b / name
        if fa.name in NOT_CHECKPOINT:
            result.files[name] = NOT_COMPARED
            continue
        if name.endswith(".safetensors"):
            for i, f in enumerate((fa, fb)):
                counts[i] += len(_header(f)[0]) - 1 if f.is_file() else 0  # minus __metadata__
        result.files[name] = _compare_file(fa, fb, name, result.differing_tensors)
    result.tensors = (counts[0], counts[1])
    del result.differing_tensors[MAX_DETAILS:]
    return result


def _compare_file(fa: Path, fb: Path, name: str, details: list[dict[str, Any]]) -> str:
    if not (fa.is_file() and fb.is_file()):
        return "only in " + ("A" if fa.is_file() else "B")
    if _same_bytes(fa, 0, fb, 0):
        return IDENTICAL
    if name.endswith(".json"):
        try:
            return SAME_JSON if json.loads(fa.read_text()) == json.loads(fb.read_text()) else "differs"
        except ValueError:
            return "differs"
    if not name.endswith(".safetensors"):
        return "differs"
    (ha, start_a), (hb, start_b) = _header(fa), _header(fb)
    if ha == hb and _same_bytes(fa, start_a, fb, start_b):
        return SAME_TENSORS
    if len(details) < MAX_DETAILS:
        details.extend(_tensor_details(fa, fb, name, ha, hb, start_a, start_b))
    return "differs"


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """The parsed header (with ``__metadata__`` as {} when absent) and where the data starts."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header["__metadata__"] = header.get("__metadata__") or {}
    return header, 8 + n


def _same_bytes(a: Path, start_a: int, b: Path, start_b: int, length: int | None = None) -> bool:
    """Whether ``a`` from ``start_a`` and ``b`` from ``start_b`` hold the same bytes (to the end, or ``length``)."""
    if length is None:
        length = a.stat().st_size - start_a
        if b.stat().st_size - start_b != length:
            return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        fa.seek(start_a)
        fb.seek(start_b)
        while length > 0:
            n = min(length, _CHUNK)
            if fa.read(n) != fb.read(n):
                return False
            length -= n
    return True


def _tensor_details(fa: Path, fb: Path, name: str, ha: dict[str, Any], hb: dict[str, Any],
                    start_a: int, start_b: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    ma, mb = ha["__metadata__"], hb["__metadata__"]
    if ma != mb:
        keys = sorted(k for k in set(ma) | set(mb) if ma.get(k) != mb.get(k))
        out.append({"file": name, "tensor": "<metadata>", "keys": keys[:10]})
    for key in sorted((set(ha) | set(hb)) - {"__metadata__"}):
        if key not in ha or key not in hb:
            out.append({"file": name, "tensor": key, "only_in": "A" if key in ha else "B"})
            continue
        ia, ib = ha[key], hb[key]
        (ba, ea), (bb, eb) = ia["data_offsets"], ib["data_offsets"]
        same_layout = ia["dtype"] == ib["dtype"] and ia["shape"] == ib["shape"]
        if same_layout and _same_bytes(fa, start_a + ba, fb, start_b + bb, ea - ba):
            if ba != bb:
                out.append({"file": name, "tensor": key, "offsets": [[ba, ea], [bb, eb]]})
            continue
        entry: dict[str, Any] = {"file": name, "tensor": key, "dtype": [ia["dtype"], ib["dtype"]],
                                 "shape": [ia["shape"], ib["shape"]]}
        if same_layout:
            entry.update(_value_diff(fa, fb, key))
        out.append(entry)
    return out


def _value_diff(fa: Path, fb: Path, key: str) -> dict[str, Any]:
    """How many elements differ, and by how much (absolute and relative, NaN/inf ignored)."""
    import torch
    from safetensors import safe_open

    with safe_open(str(fa), framework="pt") as x, safe_open(str(fb), framework="pt") as y:
        ta, tb = x.get_tensor(key), y.get_tensor(key)
    ba = ta.contiguous().reshape(-1).view(torch.uint8).reshape(-1, ta.element_size())
    bb = tb.contiguous().reshape(-1).view(torch.uint8).reshape(-1, tb.element_size())
    diff = (ba != bb).any(dim=1)
    if not diff.any():
        return {"n_diff": 0}
    va, vb = ta.float().reshape(-1)[diff], tb.float().reshape(-1)[diff]
    d = (va - vb).abs()
    return {"n_diff": int(diff.sum()), "max_abs_diff": float(d.nan_to_num(0, posinf=0, neginf=0).max()),
            "max_rel_diff": float((d / va.abs().clamp(min=1e-30)).nan_to_num(0, posinf=0, neginf=0).max())}
