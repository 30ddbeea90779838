"""Compare two saved model folders tensor by tensor: parsed safetensors headers and raw data bytes.

    python scripts/compare_checkpoints.py FOLDER_A FOLDER_B

Shard files themselves are not compared byte for byte: safetensors writes its __metadata__ map
in arbitrary key order, so two saves of the same tensors can differ in header bytes only.
Exit 0 when every tensor's bytes, dtype, shape and metadata match.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path


def read(folder: Path) -> tuple[dict[str, tuple[str, list[int], bytes]], dict[str, str]]:
    tensors: dict[str, tuple[str, list[int], bytes]] = {}
    metadata: dict[str, str] = {}
    for shard in sorted(folder.rglob("*.safetensors")):
        raw = shard.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        meta = header.pop("__metadata__", {}) or {}
        for key, value in meta.items():
            metadata[f"{shard.relative_to(folder)}:{key}"] = value
        for name, info in header.items():
            start, end = info["data_offsets"]
            key = f"{shard.parent.relative_to(folder)}/{name}"
            tensors[key] = (info["dtype"], info["shape"], raw[8 + n + start:8 + n + end])
    return tensors, metadata


def main(a: str, b: str) -> int:
    ta, ma = read(Path(a))
    tb, mb = read(Path(b))
    problems = []
    for name in sorted(set(ta) | set(tb)):
        if name not in ta or name not in tb:
            problems.append(f"{name}: only in {'A' if name in ta else 'B'}")
        elif ta[name] != tb[name]:
            (da, sa, ba), (db, sb, bb) = ta[name], tb[name]
            diff = sum(x != y for x, y in zip(ba, bb)) if len(ba) == len(bb) else -1
            problems.append(f"{name}: dtype {da}/{db} shape {sa}/{sb} differing bytes {diff} of {len(ba)}")
    for key in sorted(set(ma) | set(mb)):
        va, vb = ma.get(key), mb.get(key)
        if key.endswith(":tensor_names") and va and vb:
            va, vb = sorted(json.loads(va)), sorted(json.loads(vb))
        elif va and vb and va.startswith("{"):
            va, vb = json.loads(va), json.loads(vb)
        if va != vb:
            problems.append(f"metadata {key} differs")
    print(f"{len(ta)} tensors in A, {len(tb)} in B, {len(problems)} differences")
    for p in problems[:50]:
        print("  " + p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
