"""The safetensors header validator (publisher/streaming/validate.py) against the installed safetensors library.

Hypothesis builds valid files and corrupts them (unknown dtypes, bad shapes, gaps, overlaps, offsets out of
bounds, duplicate names, non-string metadata, bad lengths, non-JSON, non-objects, ...); for each file our
reader must accept exactly what ``safetensors.safe_open`` accepts, and refuse the rest with the same class
of error (the library's messages mapped to ``InputError.kind``). The one deliberate difference: a tensor name
or ``__metadata__`` key given twice, which the library accepts (keeping the last), is refused as "duplicate".
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from publisher.errors import InputError
from publisher.streaming.safetensors_io import read_header
from publisher.streaming.validate import DTYPE_BITS, MAX_HEADER_BYTES

# The library's messages (safetensors/src/tensor.rs, Display for SafeTensorError) -> our kinds.
LIBRARY_KINDS = [
    ("header too small", "too_small"), ("header too large", "too_large"), ("invalid header length", "length"),
    ("invalid UTF-8 in header", "utf8"), ("invalid JSON in header", "json"), ("invalid offset for tensor", "offsets"),
    ("overflow computing buffer size", "overflow"), ("slicing for subbytes dtypes", "misaligned"),
    ("invalid shape, data type, or offset for tensor", "size"), ("incomplete metadata, file not fully covered", "coverage"),
]
PER_TENSOR = {"offsets", "overflow", "misaligned", "size"}  # checked in offset order; equal offsets: any order


def library_kind(path: Path) -> str | None:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt"):
            return None
    except SafetensorError as exc:
        kind = next((k for text, k in LIBRARY_KINDS if text in str(exc)), None)
        assert kind is not None, f"unmapped library error: {exc}"
        return kind


def our_kind(path: Path) -> str | None:
    try:
        read_header(path)
    except InputError as exc:
        assert exc.kind and str(path) in str(exc), str(exc)  # one line naming the file
        return exc.kind
    return None


# ---- a JSON writer that can repeat keys and inject raw text ----------------------------------------------------
@dataclass
class Obj:
    pairs: list[tuple[str, Any]]


@dataclass
class Raw:
    text: str


def dump(value: Any) -> str:
    if isinstance(value, Obj):
        return "{" + ",".join(f"{json.dumps(k)}:{dump(v)}" for k, v in value.pairs) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dump(v) for v in value) + "]"
    if isinstance(value, Raw):
        return value.text
    return json.dumps(value)


@dataclass
class Case:
    header: Obj
    data_len: int
    dup: bool = False  # a tensor name or metadata key given twice (the one deliberate difference)
    tied: bool = False  # two tensors with equal data_offsets: the library's check order is then random
    text: str | None = None  # replaces the header text
    body: bytes | None = None  # replaces the header bytes
    length: int | None = None  # replaces the 8-byte length
    data_delta: int = 0  # bytes added to (or cut from) the data section
    cut: int | None = None  # the file is cut to this many bytes
    notes: list[str] = field(default_factory=list)

    def bytes(self) -> bytes:
        body = self.body if self.body is not None else (self.text if self.text is not None else dump(self.header)).encode()
        body += b" " * ((8 - len(body) % 8) % 8) if self.body is None and self.text is None else b""
        n = len(body) if self.length is None else self.length
        blob = struct.pack("<Q", n) + body + b"\0" * max(0, self.data_len + self.data_delta)
        return blob[:self.cut] if self.cut is not None else blob


def _t(name: str, dtype: str, shape: list[int], begin: int, end: int) -> tuple[str, Obj]:
    return name, Obj([("dtype", dtype), ("shape", shape), ("data_offsets", [begin, end])])


NAMES = st.text(alphabet="abcdefgh._0123456789", min_size=1, max_size=6)
DTYPES = st.sampled_from(sorted(DTYPE_BITS))
BAD_DTYPES = st.sampled_from(["XYZ", "bf16", "F8", "", "FLOAT32", "F8_E4M3FN"])


@st.composite
def cases(draw: Any, first: Any = None) -> Case:
    dims = st.one_of(st.integers(1, 5), st.just(0))
    specs = draw(st.lists(st.tuples(NAMES, DTYPES, st.lists(dims, max_size=3)), max_size=5, unique_by=lambda t: t[0]))
    entries: list[list[Any]] = []  # [name, dtype, shape, begin, end]
    offset = 0
    for name, dtype, shape in specs:
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * DTYPE_BITS[dtype] // 8 if numel * DTYPE_BITS[dtype] % 8 == 0 else -1
        if nbytes < 0:  # sub-byte dtypes need an even element count: make it valid first (mutations break it)
            shape = [*shape, 8] if shape else [8]
            nbytes = (numel * 8) * DTYPE_BITS[dtype] // 8
        entries.append([name, dtype, shape, offset, offset + nbytes])
        offset += nbytes
    case = Case(Obj([]), offset)
    metadata: Obj | None | Any = None
    if draw(st.booleans()):
        metadata = Obj([(k, v) for k, v in draw(st.dictionaries(NAMES, st.text(max_size=4), max_size=3)).items()])
    mutations = ([first] if first else []) + draw(st.lists(st.sampled_from(MUTATIONS), max_size=2))
    tensors: list[tuple[str, Any]] = []
    for name, dtype, shape, begin, end in entries:
        tensors.append((name, Obj([("dtype", dtype), ("shape", shape), ("data_offsets", [begin, end])])))
    state = {"tensors": tensors, "metadata": metadata}
    for mutation in mutations:
        mutation(draw, case, state)
    pairs = list(state["tensors"])
    if state["metadata"] is not None:
        pairs.insert(draw(st.integers(0, len(pairs))), ("__metadata__", state["metadata"]))
    case.header = Obj(pairs)
    case.tied = _tied(pairs)
    return case


def _tied(pairs: list[tuple[str, Any]]) -> bool:
    offsets = [dict(v.pairs).get("data_offsets") for k, v in pairs if k != "__metadata__" and isinstance(v, Obj)]
    keys = [tuple(o) for o in offsets if isinstance(o, list) and all(isinstance(x, int) for x in o)]
    return len(keys) != len(set(keys))


def _pick(draw: Any, state: dict[str, Any]) -> int | None:
    tensors = state["tensors"]
    return draw(st.integers(0, len(tensors) - 1)) if tensors else None


def _set(state: dict[str, Any], i: int, key: str, value: Any) -> None:
    name, obj = state["tensors"][i]
    if isinstance(obj, Obj):
        state["tensors"][i] = (name, Obj([(k, value if k == key else v) for k, v in obj.pairs]))


def _field(state: dict[str, Any], i: int, key: str) -> Any:
    obj = state["tensors"][i][1]
    return dict(obj.pairs).get(key) if isinstance(obj, Obj) else None


def m_dtype(draw: Any, case: Case, state: dict[str, Any]) -> None:
    i = _pick(draw, state)
    if i is not None:
        _set(state, i, "dtype", draw(st.one_of(DTYPES, BAD_DTYPES, st.just(Obj([("U8", None)])), st.just(Obj([("U8", 1)])),
                                                st.just(None), st.just(["U8"]))))


def m_shape(draw: Any, case: Case, state: dict[str, Any]) -> None:
    i = _pick(draw, state)
    if i is not None:
        bad = st.sampled_from([[-1], [1.0], [True], "2", None, [2**64], [2**64 - 1], [2**63, 4], [2**40, 2**40, 0],
                               [0, 2**40, 2**40], [2**62], [Raw("-0")], [Raw("1e400")], [Raw("1" * 400)], [3]])
        _set(state, i, "shape", draw(st.one_of(st.lists(st.integers(0, 9), max_size=3), bad)))


def m_offsets(draw: Any, case: Case, state: dict[str, Any]) -> None:
    tensors = state["tensors"]
    if not tensors:
        return
    i = draw(st.integers(0, len(tensors) - 1).map(lambda k: len(tensors) - 1 - k))  # later tensors first: overlaps
    offsets = _field(state, i, "data_offsets")
    valid = isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
    begin, end = offsets if valid else (0, 0)
    shift = draw(st.integers(1, 3))
    _set(state, i, "data_offsets", draw(st.sampled_from([
        [begin - shift, end - shift], [begin + shift, end + shift], [begin, end - shift], [begin, end + shift],
        [end, begin], [begin, end, end], [begin], [begin, end + 10**6], [float(begin), end], [begin, 2**64 + 1],
        [Raw("-0"), end],
    ])))


def m_duplicate(draw: Any, case: Case, state: dict[str, Any]) -> None:
    i = _pick(draw, state)
    if i is None:
        return
    name, obj = state["tensors"][i]
    copy = draw(st.sampled_from(["same", "other", "garbage"]))
    value = obj if copy == "same" else (Obj([("dtype", "U8"), ("shape", [0]), ("data_offsets", [0, 0])]) if copy == "other" else "x")
    state["tensors"].insert(draw(st.integers(0, len(state["tensors"]))), (name, value))
    case.dup = case.dup or (case.text is None and case.body is None)  # else the header text is already fixed


def m_metadata(draw: Any, case: Case, state: dict[str, Any]) -> None:
    choice = draw(st.sampled_from(["int", "null-value", "list", "str", "null", "dup-key", "nested", "twice"]))
    meta = state["metadata"] if isinstance(state["metadata"], Obj) else Obj([])
    if choice == "int":
        state["metadata"] = Obj([*meta.pairs, ("k", 1)])
    elif choice == "null-value":
        state["metadata"] = Obj([*meta.pairs, ("k", None)])
    elif choice == "list":
        state["metadata"] = ["a"]
    elif choice == "str":
        state["metadata"] = "x"
    elif choice == "null":
        state["metadata"] = Raw("null")
    elif choice == "dup-key":
        state["metadata"] = Obj([*meta.pairs, ("k", "1"), ("k", "2")])
        case.dup = case.dup or (case.text is None and case.body is None)
    elif choice == "nested":
        state["metadata"] = Obj([*meta.pairs, ("k", Obj([]))])
    else:
        state["metadata"] = meta
        state["tensors"].append(("__metadata__", Obj([])))


def m_entry(draw: Any, case: Case, state: dict[str, Any]) -> None:
    i = _pick(draw, state)
    if i is None:
        return
    name, obj = state["tensors"][i]
    fields = obj.pairs if isinstance(obj, Obj) else []
    choice = draw(st.sampled_from(["str", "num", "list3", "list2", "missing", "dup-field", "extra", "extra-dup", "empty"]))
    new: Any = {
        "str": "x", "num": 3, "empty": Obj([]),
        "list3": [v for _, v in fields], "list2": [v for _, v in fields][:2],
        "missing": Obj(fields[1:]), "dup-field": Obj([*fields, fields[0]] if fields else []),
        "extra": Obj([("zzz", Obj([("deep", [1, 2.5, None, True])])), *fields]),
        "extra-dup": Obj([("x", 1), ("x", 2), *fields]),
    }[choice]
    state["tensors"][i] = (name, new)


def m_json(draw: Any, case: Case, state: dict[str, Any]) -> None:
    choice = draw(st.sampled_from(["list", "null", "number", "truncated", "trailing", "nan", "surrogate", "pair",
                                   "deep127", "deep128", "bom", "ctrl", "not-utf8", "empty", "spaces", "padded"]))
    text = dump(Obj(list(state["tensors"])))  # the metadata is left out of a replaced header text
    names = [k for k, _ in state["tensors"] if k != "__metadata__"]
    if choice not in ("nan", "deep127", "deep128"):
        case.dup = len(names) != len(set(names))
    if choice in ("list", "null", "number"):
        case.text = {"list": "[]", "null": "null", "number": "3"}[choice]
    elif choice == "truncated":
        case.text = text[: max(0, len(text) - draw(st.integers(1, 5)))]
    elif choice == "trailing":
        case.text = text + draw(st.sampled_from(["\0", " x", "}", "\x0c"]))
    elif choice == "nan":
        state["tensors"].append(("n", Obj([("x", Raw("NaN")), ("dtype", "U8"), ("shape", [0]), ("data_offsets", [0, 0])])))
    elif choice in ("surrogate", "pair"):
        escape = "\\ud800" if choice == "surrogate" else "\\ud83d\\ude00"
        case.text = text[:-1] + ("," if state["tensors"] else "") + f'"s{escape}":{{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}}}'
    elif choice in ("deep127", "deep128"):
        depth = 125 if choice == "deep127" else 126  # plus the header object and the tensor object
        state["tensors"].append(("d", Obj([("x", Raw("[" * depth + "]" * depth)), ("dtype", "U8"), ("shape", [0]),
                                           ("data_offsets", [0, 0])])))
    elif choice == "bom":
        case.body = b"\xef\xbb\xbf" + text.encode()
    elif choice == "ctrl":
        case.text = text[:-1] + ("," if state["tensors"] else "") + '"c\x01":"x"}'
    elif choice == "not-utf8":
        case.body = text.encode()[:-1] + b'"\xff":1}'
    elif choice == "empty":
        case.text = ""
    elif choice == "spaces":
        case.text = "\t\r\n " + text + "  \n"
    else:
        case.body = text.encode() + b" " * draw(st.integers(0, 9))


def m_length(draw: Any, case: Case, state: dict[str, Any]) -> None:
    choice = draw(st.sampled_from(["past-end", "huge", "over-cap", "99MB", "short", "zero", "cut"]))
    if choice == "past-end":
        case.length = len(dump(Obj(state["tensors"]))) + case.data_len + draw(st.integers(9, 100))
    elif choice == "huge":
        case.length = 2**63
    elif choice == "over-cap":
        case.length = MAX_HEADER_BYTES + 1
    elif choice == "99MB":
        case.length = 99_000_000
    elif choice == "short":
        case.length = max(0, len(dump(Obj(state["tensors"]))) - draw(st.integers(1, 8)))
    elif choice == "zero":
        case.length = 0
    else:
        case.cut = draw(st.integers(0, 7))


def m_data(draw: Any, case: Case, state: dict[str, Any]) -> None:
    case.data_delta = draw(st.sampled_from([-3, -1, 1, 7, 64]))


def m_none(draw: Any, case: Case, state: dict[str, Any]) -> None:
    """Keeps the file valid (unless another mutation breaks it)."""


MUTATIONS = [m_dtype, m_shape, m_offsets, m_duplicate, m_metadata, m_entry, m_json, m_length, m_data, m_none]


def repeats(case: Case) -> bool:
    """Whether the header gives a tensor name, or a key of one metadata object, twice: ``case.dup``, or what the header
    as written shows (a mutation can repeat a name another one made without saying so: m_duplicate's copy, then
    m_json's deep127, found by this test), and what it no longer shows (m_metadata's dup-key, then its null, which
    replaces the object that held the repeat: found by this test on 2026-12-05). ``case.dup`` is trusted only where the
    header's text is given whole."""
    if case.text is not None or case.body is not None:
        return case.dup
    names = [k for k, _ in case.header.pairs if k != "__metadata__"]
    metas = [v.pairs for k, v in case.header.pairs if k == "__metadata__" and isinstance(v, Obj)]
    return len(names) != len(set(names)) or any(len(m) != len({k for k, _ in m}) for m in metas)


def check(case: Case, path: Path) -> None:
    path.write_bytes(case.bytes())
    lib, ours = library_kind(path), our_kind(path)
    if lib is None and repeats(case):
        assert ours == "duplicate", (lib, ours)
    elif lib in PER_TENSOR and case.tied:
        assert ours in PER_TENSOR, (lib, ours)
    else:
        assert ours == lib, (lib, ours)
    if lib is None and ours is None:  # same reading: names, dtypes, shapes, metadata
        from safetensors import safe_open

        metadata, entries = read_header(path)
        with safe_open(str(path), framework="pt") as f:
            assert sorted(entries) == sorted(f.keys())
            assert metadata == (f.metadata() or {})
            for name, entry in entries.items():
                assert entry.dtype == f.get_slice(name).get_dtype()
                if DTYPE_BITS[entry.dtype] >= 8:  # the library packs sub-byte shapes for torch
                    assert list(entry.shape) == f.get_slice(name).get_shape()


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.__name__[2:] for m in MUTATIONS])
def test_validator_accepts_exactly_what_the_library_accepts(mutation: Any, tmp_path: Path) -> None:
    """40 generated files per kind of corruption (400 in all), each with up to two more corruptions on top."""
    path = tmp_path / f"generated-{mutation.__name__}.safetensors"

    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(case=cases(mutation))
    @example(case=Case(Obj([_t("a", "F32", [2], 0, 8)]), 8))
    @example(case=Case(Obj([_t("d", "U8", [0], 0, 0), _t("d", "U8", [0], 0, 0)]), 0))  # a repeat `dup` does not flag
    def run(case: Case) -> None:
        check(case, path)

    run()


# The malformed inputs named in issue 13, each against the library (deterministic, in addition to the above).
ISSUE_CASES = {
    "end < begin": (Case(Obj([_t("a", "U8", [0], 4, 0)]), 4), "offsets"),
    "numel x itemsize != end - begin": (Case(Obj([_t("a", "F32", [3], 0, 8)]), 8), "size"),
    "overlapping offsets": (Case(Obj([_t("a", "U8", [4], 0, 4), _t("b", "U8", [4], 2, 6)]), 6), "offsets"),
    "gap between tensors": (Case(Obj([_t("a", "U8", [4], 0, 4), _t("b", "U8", [4], 5, 9)]), 9), "offsets"),
    "offsets out of bounds": (Case(Obj([_t("a", "U8", [4], 0, 4)]), 2), "coverage"),
    "length prefix 2**63": (Case(Obj([]), 0, length=2**63), "too_large"),
    "length prefix 99 MB": (Case(Obj([]), 0, length=99_000_000), "length"),
    "header is a list": (Case(Obj([]), 0, text="[]"), "json"),
    "entry not an object": (Case(Obj([("a", "x")]), 0), "json"),
    "unknown dtype XYZ": (Case(Obj([_t("a", "XYZ", [1], 0, 1)]), 1), "json"),
    "dtype F8_E8M0 (known to safetensors 0.8)": (Case(Obj([_t("a", "F8_E8M0", [2], 0, 2)]), 2), None),
    "non-string metadata": (Case(Obj([("__metadata__", Obj([("k", 1)])), _t("a", "U8", [1], 0, 1)]), 1), "json"),
    "file shorter than 8 bytes": (Case(Obj([]), 0, cut=5), "too_small"),
    "not UTF-8": (Case(Obj([]), 0, body=b'{"\xff":1}'), "utf8"),
    "duplicate tensor names": (Case(Obj([_t("a", "U8", [1], 0, 1), _t("a", "U8", [1], 0, 1)]), 1, dup=True), "duplicate"),
}


def _extra(value: str) -> Case:
    """A valid one-tensor file with an extra (ignored) member holding ``value``, raw."""
    return Case(Obj([("a", Obj([("x", Raw(value)), ("dtype", "U8"), ("shape", [1]), ("data_offsets", [0, 1])]))]), 1)


# Where serde_json and Python's json differ, and the library's less obvious acceptances: pinned, not left to chance.
QUIRKS = {
    "-0 as an offset": (Case(Obj([("a", Obj([("dtype", "U8"), ("shape", [0]), ("data_offsets", [Raw("-0"), 0])]))]), 0), "json"),
    "-0 in an ignored member": (_extra("-0"), None),
    "integer past u64 in an ignored member": (_extra("1" * 40), None),
    "integer past the double range": (_extra("1" * 400), "json"),
    "1e400": (_extra("1e400"), "json"),
    "NaN": (_extra("NaN"), "json"),
    "nesting of 127 levels": (_extra("[" * 125 + "]" * 125), None),
    "nesting of 128 levels": (_extra("[" * 126 + "]" * 126), "json"),
    "unpaired surrogate escape": (_extra('"\\udc00"'), "json"),
    "surrogate pair escape": (_extra('"\\ud83d\\ude00"'), None),
    "duplicate ignored member": (Case(Obj([("a", Obj([("x", 1), ("x", 2), ("dtype", "U8"), ("shape", [1]),
                                                       ("data_offsets", [0, 1])]))]), 1), None),
    "duplicate dtype member": (Case(Obj([("a", Obj([("dtype", "U8"), ("dtype", "U8"), ("shape", [1]),
                                                     ("data_offsets", [0, 1])]))]), 1), "json"),
    "tensor as a 3-element list": (Case(Obj([("a", ["U8", [1], [0, 1]])]), 1), None),
    "dtype as {name: null}": (Case(Obj([("a", Obj([("dtype", Obj([("U8", None)])), ("shape", [1]),
                                                   ("data_offsets", [0, 1])]))]), 1), None),
    "__metadata__ twice": (Case(Obj([("__metadata__", Obj([])), ("__metadata__", Obj([]))]), 0), "json"),
    "__metadata__ null": (Case(Obj([("__metadata__", None)]), 0), None),
    "earlier duplicate not a tensor": (Case(Obj([("a", "x"), _t("a", "U8", [1], 0, 1)]), 1, dup=True), "json"),
    "UTF-8 byte order mark": (Case(Obj([]), 0, body=b"\xef\xbb\xbf{}"), "json"),
    "F4 with an odd element count": (Case(Obj([_t("a", "F4", [3], 0, 2)]), 2), "misaligned"),
    "F4 with an even element count": (Case(Obj([_t("a", "F4", [4], 0, 2)]), 2), None),
    "shape overflowing 64 bits": (Case(Obj([_t("a", "U8", [2**40, 2**40], 0, 0)]), 0), "overflow"),
    "bytes left after the last tensor": (Case(Obj([_t("a", "U8", [1], 0, 1)]), 1, data_delta=3), "coverage"),
    "empty header object": (Case(Obj([]), 0), None),
    "empty file": (Case(Obj([]), 0, cut=0), "too_small"),
}


@pytest.mark.parametrize("name", list(QUIRKS))
def test_quirks(name: str, tmp_path: Path) -> None:
    case, kind = QUIRKS[name]
    path = tmp_path / "x.safetensors"
    check(case, path)
    assert our_kind(path) == kind


@pytest.mark.parametrize("name", list(ISSUE_CASES))
def test_issue_cases(name: str, tmp_path: Path) -> None:
    case, kind = ISSUE_CASES[name]
    path = tmp_path / "x.safetensors"
    check(case, path)
    assert our_kind(path) == kind


def test_range_read_is_validated_like_a_local_file(tmp_path: Path) -> None:
    """A file read through anything with read/seek and a learnt ``size`` (a RangeFile) gets the same rules."""
    import io

    case, _ = ISSUE_CASES["overlapping offsets"]
    blob = case.bytes()

    class Remote(io.BytesIO):
        name = "org/repo@0123/x.safetensors"
        size = len(blob)

        def fileno(self) -> int:
            raise io.UnsupportedOperation

    with pytest.raises(InputError, match=r"org/repo@0123/x.safetensors is not a valid safetensors file: tensor 'b'") as exc:
        read_header(Remote(blob))
    assert exc.value.kind == "offsets"


def test_a_repeat_a_later_mutation_removed_is_not_one() -> None:
    """m_metadata's dup-key, then its null: the header holds no repeat any more, whatever ``case.dup`` says."""
    assert not repeats(Case(Obj([("__metadata__", Raw("null"))]), 0, dup=True))
    assert repeats(Case(Obj([("__metadata__", Obj([("k", "1"), ("k", "2")]))]), 0))
