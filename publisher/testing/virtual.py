"""Virtual safetensors files: a real header, and tensor bytes computed from a seed as they are served.

The loopback Hub serves them like any LFS file (``POST /_admin/virtual`` registers them), so a benchmark can
publish a model with FLUX.1-dev's real shapes (33 GB of base weights) without any base file on the local disk:
every byte range is produced on the fly, deterministically, at memory speed. Standard library only (the server
imports it).

Tensor data is bfloat16 throughout: a 16 MiB pattern of finite values of magnitude 2^-7 to 2^-5 with random signs
and mantissas, repeated from an offset that depends on the seed. The pattern is element-aligned (the data section
of a safetensors file starts at an 8-byte boundary), so every tensor holds ordinary bf16 numbers.

With ``noise``, the values are of the same kind but never repeat (each 1 MiB block of the data drawn from its own
seed): a repeated pattern is what Xet's content-defined chunking deduplicates, so a file meant to cost what a real
checkpoint costs on the Xet path (bytes stored, transferred, buffered) takes ``noise``.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import random
import struct
from collections.abc import Iterator
from dataclasses import dataclass

PATTERN_BYTES = 16 << 20
CHUNK = 1 << 20


@functools.lru_cache(maxsize=1)
def pattern() -> bytes:
    """The bf16 pattern: low byte random (exponent's last bit and mantissa), high byte a random sign and an
    exponent of 120 or 121, so every value is finite, normal and between 2^-7 and 2^-5 in magnitude."""
    rng = random.Random(20240607)
    n = PATTERN_BYTES // 2
    lo = rng.randbytes(n)
    hi = rng.randbytes(n).translate(bytes((b & 0x80) | 60 for b in range(256)))
    out = bytearray(PATTERN_BYTES)
    out[0::2] = lo
    out[1::2] = hi
    return bytes(out)


def header_bytes(tensors: list[tuple[str, tuple[int, ...]]], metadata: dict[str, str] | None = None) -> tuple[bytes, int]:
    """(header with its length prefix, data size) of a safetensors file of bf16 ``tensors``, laid out as safetensors
    lays them out (by name, one dtype)."""
    entries: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, shape in sorted(tensors):
        size = 2
        for d in shape:
            size *= d
        entries[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    body = json.dumps(entries, separators=(",", ":")).encode()
    body += b" " * ((8 - len(body) % 8) % 8)
    return struct.pack("<Q", len(body)) + body, offset


NOISE_BLOCK = 1 << 20


@functools.lru_cache(maxsize=1)
def _high_bytes() -> bytes:
    return bytes((b & 0x80) | 60 for b in range(256))  # a random sign, exponent 120 or 121: finite and normal


def noise_block(seed: int, index: int) -> bytes:
    """Data block ``index`` of a noise file: NOISE_BLOCK bytes of bf16 values, from their own seed."""
    rng = random.Random(seed * 1_000_003 + index)
    n = NOISE_BLOCK // 2
    out = bytearray(NOISE_BLOCK)
    out[0::2] = rng.randbytes(n)
    out[1::2] = rng.randbytes(n).translate(_high_bytes())
    return bytes(out)


@dataclass(frozen=True)
class VirtualFile:
    header: bytes
    size: int  # the whole file
    seed: int
    noise: bool = False  # data that never repeats (see the module's docstring)

    @property
    def salt(self) -> int:
        return (self.seed * 2654435761 * 2) % PATTERN_BYTES  # even: bf16 elements stay aligned

    def read(self, start: int, end: int) -> Iterator[bytes]:
        """Bytes ``start`` to ``end`` (inclusive), in chunks of at most ``CHUNK``."""
        head = len(self.header)
        pos = start
        while pos <= end:
            if pos < head:
                stop = min(end + 1, head)
                yield self.header[pos:stop]
                pos = stop
                continue
            if self.noise:
                index, at = divmod(pos - head, NOISE_BLOCK)
                n = min(end + 1 - pos, NOISE_BLOCK - at)
                yield noise_block(self.seed, index)[at:at + n]
                pos += n
                continue
            at = (pos - head + self.salt) % PATTERN_BYTES
            n = min(end + 1 - pos, CHUNK, PATTERN_BYTES - at)
            yield pattern()[at:at + n]
            pos += n

    def sha256(self) -> str:
        h = hashlib.sha256()
        for chunk in self.read(0, self.size - 1):
            h.update(chunk)
        return h.hexdigest()

    def to_json(self) -> dict[str, object]:
        return {"header": base64.b64encode(self.header).decode(), "size": self.size, "seed": self.seed,
                "noise": self.noise}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> VirtualFile:
        return cls(base64.b64decode(str(data["header"])), int(str(data["size"])), int(str(data["seed"])),
                   bool(data.get("noise", False)))


def safetensors_file(tensors: list[tuple[str, tuple[int, ...]]], seed: int, metadata: dict[str, str] | None = None,
                     noise: bool = False) -> VirtualFile:
    header, data = header_bytes(tensors, metadata)
    return VirtualFile(header, len(header) + data, seed, noise)
