"""The hostile-input suite (issue 13): malformed and hostile bases, local and on the loopback Hub.

Every case must end with exit code 1 and exactly one ``Error:`` line naming the file (no traceback), before
anything is created: no repo on the Hub (pushing cases run with a write token), nothing in the output folder, in
HOME, TMPDIR or the working folder (only the download cache may be written), the base itself untouched, and peak
memory under ``RSS_BOUND``. The cases run in one worker process (tests/hostile_worker.py) so torch & co are imported
once; see there for how memory is measured. Cases already in the bad-input catalogue (test_bad_input.py: remote
code via auto_map, unknown components...) and test_reliability.py (an index naming ``../`` shards) are not repeated.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import seed

GiB = 1024**3
# Measured here (tests/hostile_worker.py, VmHWM per case): 0.37-0.39 GiB for every case, torch, diffusers and
# transformers imported; with the JSON size limit lifted, the 200 MB config.json case peaked at 0.74 GiB.
RSS_BOUND = 640 * 1024**2

Mutate = Callable[[Path, Path], None]  # (base folder, case sandbox)


@dataclass(frozen=True)
class Hostile:
    id: str
    base: str  # "llama", "llama-sharded" or "flux"
    mutate: Mutate
    needles: tuple[str, ...]  # in the one Error: line
    hub: bool = False  # seeded on the loopback Hub and published with a write token (else a local folder, --no-push)
    extra: tuple[str, ...] = ()


# ---- safetensors surgery ---------------------------------------------------------------------------------------
def _split(path: Path) -> tuple[dict[str, Any], bytes]:
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def _write(path: Path, header: Any, data: bytes, length: int | None = None) -> None:
    body = header if isinstance(header, bytes) else (header if isinstance(header, str) else json.dumps(header)).encode()
    body += b" " * ((8 - len(body) % 8) % 8)
    path.write_bytes(struct.pack("<Q", len(body) if length is None else length) + body + data)


def _by_offset(header: dict[str, Any]) -> list[str]:
    names = [k for k in header if k != "__metadata__" and header[k]["data_offsets"][1] > header[k]["data_offsets"][0]]
    return sorted(names, key=lambda k: header[k]["data_offsets"][0])


def st(edit: Callable[[dict[str, Any], bytes], tuple[Any, ...]], file: str = "model.safetensors") -> Mutate:
    """Rewrite a safetensors file of the base: ``edit(header, data)`` returns (header, data[, length])."""
    def mutate(base: Path, sandbox: Path) -> None:
        header, data = _split(base / file)
        _write(base / file, *edit(header, data))
    return mutate


def _shift(k: int, by: int) -> Callable[[dict[str, Any], bytes], tuple[Any, ...]]:
    def edit(h: dict[str, Any], d: bytes) -> tuple[Any, ...]:
        name = _by_offset(h)[k]
        h[name]["data_offsets"] = [o + by for o in h[name]["data_offsets"]]
        return h, d
    return edit


def _set(k: int, field: str, value: Callable[[Any], Any]) -> Callable[[dict[str, Any], bytes], tuple[Any, ...]]:
    def edit(h: dict[str, Any], d: bytes) -> tuple[Any, ...]:
        name = _by_offset(h)[k]
        h[name][field] = value(h[name][field])
        return h, d
    return edit


def _duplicate(h: dict[str, Any], d: bytes) -> tuple[Any, ...]:
    first = _by_offset(h)[0]
    text = json.dumps(h)
    return text[:-1] + f", {json.dumps(first)}: {json.dumps(h[first])}}}", d


def write(name: str, content: str | bytes) -> Mutate:
    def mutate(base: Path, sandbox: Path) -> None:
        (base / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return mutate


def edit_json(name: str, fn: Callable[[dict[str, Any]], None]) -> Mutate:
    def mutate(base: Path, sandbox: Path) -> None:
        doc = json.loads((base / name).read_text())
        fn(doc)
        (base / name).write_text(json.dumps(doc))
    return mutate


# ---- sharded checkpoints ---------------------------------------------------------------------------------------
def shard(base: Path) -> None:
    """Split the tiny llama's model.safetensors into two shards and an index, as save_pretrained would."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(base / "model.safetensors"))
    keys = sorted(state)
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    parts = [keys[: len(keys) // 2], keys[len(keys) // 2:]]
    for name, part in zip(names, parts):
        save_file({k: state[k] for k in part}, str(base / name), metadata={"format": "pt"})
    weight_map = {k: name for name, part in zip(names, parts) for k in part}
    (base / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (base / "model.safetensors").unlink()


def _weight_map(fn: Callable[[dict[str, str]], None]) -> Mutate:
    return edit_json("model.safetensors.index.json", lambda doc: fn(doc["weight_map"]))


def _unnamed_shard(base: Path, sandbox: Path) -> None:
    shutil.copyfile(base / "model-00002-of-00002.safetensors", base / "model-00003-of-00003.safetensors")


def _tensor_in_two_shards(base: Path, sandbox: Path) -> None:
    from safetensors.torch import load_file, save_file

    first = load_file(str(base / "model-00001-of-00002.safetensors"))
    second = load_file(str(base / "model-00002-of-00002.safetensors"))
    key = sorted(first)[0]
    save_file({**second, key: first[key]}, str(base / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})


# ---- folder entries --------------------------------------------------------------------------------------------
def _link_out(base: Path, sandbox: Path) -> None:
    (sandbox / "secret.txt").write_text("TOKEN=hunter2\n")
    (base / "LICENSE-EXTRA").symlink_to(sandbox / "secret.txt")


def _linked_folder(base: Path, sandbox: Path) -> None:
    (base / "docs").mkdir()
    (base / "docs" / "a.txt").write_text("a")
    (base / "docs-link").symlink_to("docs")


def _socket(base: Path, sandbox: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(base / "agent.sock"))
    s.close()


def _users_partial(base: Path, sandbox: Path) -> None:
    (sandbox / "out" / "precious.partial").mkdir(parents=True)
    (sandbox / "out" / "precious.partial" / "thesis.tex").write_text("years of work")


def _linked_partial(base: Path, sandbox: Path) -> None:
    (sandbox / "precious").mkdir()
    (sandbox / "precious" / "thesis.tex").write_text("years of work")
    (sandbox / "out").mkdir()
    (sandbox / "out" / "x.partial").symlink_to(sandbox / "precious")


def _model_index(fn: Callable[[dict[str, Any]], None]) -> Mutate:
    return edit_json("model_index.json", fn)


CASES = [
    # safetensors headers (local: read from disk; hub: by HTTP range at plan time)
    Hostile("header length past the end", "llama", st(lambda h, d: (h, d, 10**6)), ("model.safetensors", "header length 1000000 points past the end")),
    Hostile("header length past the end (hub)", "llama", st(lambda h, d: (h, d, 10**6)), ("model.safetensors", "points past the end"), hub=True),
    Hostile("header length 2**63", "llama", st(lambda h, d: (h, d, 2**63)), ("model.safetensors", "over the limit of 100,000,000 bytes")),
    Hostile("header length 99 MB (hub)", "llama", st(lambda h, d: (h, d, 99_000_000)), ("header length 99000000 points past the end",), hub=True),
    Hostile("file shorter than 8 bytes (hub)", "llama", write("model.safetensors", b"\x01\x02\x03\x04\x05"), ("model.safetensors", "5 bytes long, shorter than the 8-byte header length"), hub=True),
    Hostile("header not JSON", "llama", st(lambda h, d: ('{"model.norm.weight": ', d)), ("model.safetensors", "its header is not JSON")),
    Hostile("header not an object", "llama", st(lambda h, d: ("[]", d)), ("its header is a list, not a JSON object",)),
    Hostile("entry not an object", "llama", st(lambda h, d: ({**h, _by_offset(h)[0]: "x"}, d)), ("is a string, not an object",)),
    Hostile("end before begin", "llama", st(_set(1, "data_offsets", lambda o: o[::-1])), ("ends before it begins",)),
    Hostile("numel x itemsize != end - begin", "llama", st(_set(0, "shape", lambda s: [s[0] + 1, *s[1:]])), ("but its data_offsets",)),
    Hostile("overlapping offsets (hub, --low-disk)", "llama", st(_shift(1, -2)), ("they overlap",), hub=True, extra=("--low-disk",)),
    Hostile("gap between tensors", "llama", st(_shift(1, 2)), ("a gap",)),
    Hostile("duplicate tensor names", "llama", st(_duplicate), ("is given twice in the header",)),
    Hostile("unknown dtype XYZ", "llama", st(_set(0, "dtype", lambda v: "XYZ")), ("unknown dtype 'XYZ'",)),
    Hostile("non-string metadata", "llama", st(lambda h, d: ({**h, "__metadata__": {"format": 1}}, d)), ("__metadata__ value of 'format' is a number",)),
    Hostile("kept component's header (vae)", "flux", st(_shift(1, -2), "vae/diffusion_pytorch_model.safetensors"), ("vae/diffusion_pytorch_model.safetensors", "they overlap")),
    # *.safetensors.index.json
    Hostile("index not JSON", "llama-sharded", write("model.safetensors.index.json", '{"weight_map": '), ("model.safetensors.index.json is not valid JSON",)),
    Hostile("index not an object (hub)", "llama-sharded", write("model.safetensors.index.json", "[]"), ("model.safetensors.index.json is not a JSON object (it is a list)",), hub=True),
    Hostile("index without weight_map", "llama-sharded", write("model.safetensors.index.json", '{"metadata": {}}'), ("model.safetensors.index.json has no weight_map",)),
    Hostile("index weight_map a list", "llama-sharded", write("model.safetensors.index.json", '{"weight_map": [["a", "b"]]}'), ("weight_map is a list, not an object",)),
    Hostile("index not UTF-8", "llama-sharded", write("model.safetensors.index.json", b'{"weight_map": {"\xff": 1}}'), ("model.safetensors.index.json is not UTF-8",)),
    Hostile("index names a shard not in the repo (hub)", "llama-sharded", _weight_map(lambda m: m.update({sorted(m)[0]: "model-00003-of-00003.safetensors"})), ("names the shard model-00003-of-00003.safetensors", "incomplete"), hub=True),
    Hostile("shard the index does not name", "llama-sharded", _unnamed_shard, ("model-00003-of-00003.safetensors is a shard that", "does not name")),
    Hostile("tensor in two shards (hub)", "llama-sharded", _tensor_in_two_shards, ("is in two shards of",), hub=True),
    # config.json and model_index.json
    Hostile("config.json not JSON", "llama", write("config.json", '{"model_type": '), ("config.json is not valid JSON",)),
    Hostile("config.json not an object (hub)", "llama", write("config.json", "[1]"), ("config.json is not a JSON object (it is a list)",), hub=True),
    Hostile("config.json not UTF-8", "llama", write("config.json", b'{"model_type": "\xff"}'), ("config.json is not UTF-8",)),
    Hostile("config.json of 200 MB", "llama", write("config.json", "{" + " " * 200_000_000 + '"model_type": "llama"}'), ("config.json is 200.0 MB, over the 16 MiB limit",)),
    Hostile("component config.json not JSON", "flux", write("transformer/config.json", "{"), ("transformer/config.json is not valid JSON",)),
    Hostile("model_index.json not JSON (hub)", "flux", write("model_index.json", "{"), ("model_index.json is not valid JSON",), hub=True),
    Hostile("model_index.json not an object", "flux", write("model_index.json", '"FluxPipeline"'), ("model_index.json is not a JSON object (it is a string)",)),
    Hostile("component named ../x", "flux", _model_index(lambda d: d.update({"../x": ["diffusers", "AutoencoderKL"]})), ("names a component '../x'", "not a plain folder name")),
    Hostile("component named /etc (hub)", "flux", _model_index(lambda d: d.update({"/etc": ["diffusers", "AutoencoderKL"]})), ("names a component '/etc'",), hub=True),
    Hostile("component from a custom library", "flux", _model_index(lambda d: d.update({"text_encoder": ["my_pkg", "MyEncoder"]})), ("needs remote code (component text_encoder from 'my_pkg')", "--trust-remote-code")),
    Hostile("custom pipeline class", "flux", _model_index(lambda d: d.update({"_class_name": ["my_pipeline", "MyPipeline"]})), ("needs remote code (custom pipeline", "--trust-remote-code")),
    # the base folder's entries
    Hostile("link leaving the base folder", "llama", _link_out, ("has links that leave it or lead nowhere: LICENSE-EXTRA -> ", "secret.txt")),
    Hostile("dangling link", "llama", lambda b, s: (b / "NOTICE").symlink_to(b / "missing"), ("NOTICE -> ", "(dangling or looping)")),
    Hostile("linked folder", "llama", _linked_folder, ("docs-link (a linked folder)",)),
    Hostile("FIFO in the base folder", "llama", lambda b, s: os.mkfifo(b / "notes.fifo"), ("notes.fifo (a FIFO)",)),
    Hostile("socket in the base folder", "llama", _socket, ("agent.sock (a socket)",)),
    # --output-dir: only our own leftovers are ever deleted
    Hostile("a user's *.partial folder in --output-dir", "llama", _users_partial, ("is not empty (precious.partial is not an unfinished folder of hf-ao-publish",)),
    Hostile("a linked *.partial folder in --output-dir", "llama", _linked_partial, ("is not empty (x.partial is not an unfinished folder",)),
]


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60].strip("-")


def _snapshot(sandbox: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry of a case's folder (base, output folder, files outside the base) but the worker's run/ folder."""
    out = {}
    for p in sorted(sandbox.rglob("*")):
        rel = p.relative_to(sandbox).as_posix()
        if rel != "run" and not rel.startswith("run/"):
            st_ = p.lstat()
            out[rel] = (st_.st_mode, st_.st_size, st_.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def outcomes(hub: Any, tiny_llama_dir: Path, tiny_flux_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Build every case, run them all in the worker; {case id: (result, case folder before, case folder after)}."""
    root = tmp_path_factory.mktemp("hostile")
    sources = {"llama": tiny_llama_dir, "flux": tiny_flux_dir}
    plan, before = [], {}
    for case in CASES:
        sandbox = root / _slug(case.id)
        base = sandbox / "base"
        shutil.copytree(sources[case.base.split("-")[0]], base, symlinks=True)
        if case.base == "llama-sharded":
            shard(base)
        case.mutate(base, sandbox)
        if case.hub:
            repo = f"meta/hostile-{_slug(case.id)}"
            seed(repo, base, "tok_meta")
            args, token = [repo, "--quant", "int8wo", *case.extra], "tok_alice"
        else:
            args = [str(base), "--quant", "int8wo", "--no-push", "--output-dir", str(sandbox / "out"), *case.extra]
            token = None
        before[case.id] = _snapshot(sandbox)
        plan.append({"id": case.id, "sandbox": str(sandbox / "run"), "args": args, "token": token, "timeout": 120})
    (root / "plan.json").write_text(json.dumps(plan))
    store_before = {(r["id"], json.dumps(r["refs"], sort_keys=True)) for r in hub.store.list_repos("model")}
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(root / "hf_home"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")) if p)}
    env.pop("HF_TOKEN", None)
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("hostile_worker.py")), str(root / "plan.json"),
                           str(root / "results.json")], env=env, cwd=root, capture_output=True, text=True, timeout=1800)
    results = json.loads((root / "results.json").read_text()) if (root / "results.json").exists() else {}
    assert proc.returncode == 0 and len(results) == len(CASES), proc.stderr[-3000:]
    store_after = {(r["id"], json.dumps(r["refs"], sort_keys=True)) for r in hub.store.list_repos("model")}
    assert store_after == store_before, "the hostile cases changed the Hub (private repos included)"
    outcomes = {}
    for case in CASES:
        outcomes[case.id] = (results[case.id], before[case.id], _snapshot(root / _slug(case.id)))
    for big in root.glob("*/base/config.json"):
        if big.stat().st_size > 1_000_000:
            big.unlink()  # the 200 MB case: not left in pytest's kept temporary folders
    return outcomes


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input(outcomes: dict[str, Any], case: Hostile) -> None:
    result, before, after = outcomes[case.id]
    assert result["code"] == 1, result["stderr"][-3000:]
    assert "Traceback" not in result["stderr"] + result["stdout"]
    errors = [line for line in result["stderr"].splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result["stderr"]
    for needle in case.needles:
        assert needle in errors[0], errors[0]
    assert result["repos_changed"] == [], "a repo was created or changed on the Hub"
    assert result["written"] == {"home": [], "tmp": [], "cwd": []}, "files written outside the output and cache folders"
    assert after == before, "the base folder, the output folder or the case's folder was changed"
    assert result["peak_rss"] < RSS_BOUND, f"peak RSS {result['peak_rss'] / GiB:.2f} GiB"
    assert "hunter2" not in result["stderr"] + result["stdout"]


@pytest.mark.slow
def test_every_case_is_refused_fast(outcomes: dict[str, Any]) -> None:
    """Refused before any weight is read: no case takes long (a 200 MB config.json used to take 2.5 minutes)."""
    slow = {cid: r["seconds"] for cid, (r, _, _) in outcomes.items() if r["seconds"] > 60}  # the first imports torch
    assert not slow, slow
