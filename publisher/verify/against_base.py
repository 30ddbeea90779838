"""`verify TARGET` against its base: the base's layers re-quantized with the target's declared config, compared
tensor for tensor with what the target holds.

The base is ``--base BASE`` (a folder or a Hub repo), else the ``base_model`` of the target's hf_ao_publish.json or of
its card, when that is reachable. Its component is loaded by the library's own ``from_pretrained`` with the target's
own ``quantization_config`` (rebuilt by ``TorchAoConfig.from_dict``), in the dtype the target's tensors record, the
way the target was made; the target is loaded by the library path in this process, and every tensor of the two state
dicts is compared:

- **bit for bit** when the target is known to be made as here: our hf_ao_publish.json records this torch and torchao
  and a recipe that quantizes deterministically on this device (every CPU recipe; FP8 through fp8cpu). Any tensor
  that differs fails, by name;
- otherwise (another tool, other versions, another device: a GPU divides by multiplying with a reciprocal) tensors
  that are not bit-identical must be of the same class and shape and within a **bound**: the target's quantization
  error against the base's own weights at most ``ERROR_FACTOR`` times the re-quantization's (plus ``ERROR_SLACK``),
  and an unquantized tensor within bfloat16 rounding of the base's. A zeroed scale (error 1.0), sign-flipped weights
  (about 2.0) or a NaN fail, naming the tensor with both figures.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from publisher.errors import QuantizeError, SourceError
from publisher.fp8cpu import allow_cpu_float8_quantization
from publisher.handoffs.report import ContentCheck
from publisher.loadpath import load_component, tensor_digest
from publisher.verify import hashes as hashes_check
from publisher.verify.declared import Declared
from publisher.verify.target_layout import TargetComponent, read_json

log = logging.getLogger(__name__)

ERROR_FACTOR = 1.25  # the target's error vs the base may exceed the re-quantization's by 25% (rounding differences)
ERROR_SLACK = 1e-6
PLAIN_BOUND = 2.0**-8  # relative difference of an unquantized tensor: bfloat16 rounding
NO_BASE_BOUND = 2.0**-4  # a quantized tensor whose base weight cannot be read: relative to the re-quantized one


@dataclass
class Base:
    name: str  # as given or recorded: a Hub repo id or a folder
    origin: str  # "--base", "its hf_ao_publish.json", "its card (base_model)"
    folder: Path | None  # a local folder
    sha: str | None = None  # the Hub commit
    recorded: Any = None  # the state file's base_files (hashes the target recorded), when the base is the state's

    @property
    def display(self) -> str:
        return f"{self.name}@{self.sha[:12]}" if self.sha else self.name

    def named_by(self, recorded: Any) -> bool:
        """Whether a state file's ``base_model`` names this base: a Hub repo by its id, a local folder by its own name
        (what a publish records: state.py) or, as earlier releases recorded it, by its path."""
        if self.folder is None:
            return recorded == self.name
        return recorded in (self.folder.name, self.name, str(self.folder))


def find(explicit: str | None, named: str | None, origin: str, state: dict[str, Any] | None, token: str | None
         ) -> tuple[Base | None, str]:
    """The base to compare with, or (None, why there is none). An explicit base that cannot be read is an error; a
    named one that cannot be reached is a reason."""
    name = explicit or named
    if not name:
        return None, "no base named: no --base, and no base_model in its card or hf_ao_publish.json"
    recorded = state if state and state.get("base_model") == name else None
    if Path(name).expanduser().is_dir():
        return Base(name, origin if not explicit else "--base", Path(name).expanduser().resolve()), ""
    if not explicit and recorded and str(recorded.get("base_sha", "")).startswith("local-"):
        # a publish names a local base by its folder's name (state.py), never its path: no Hub repo of that name
        return None, (f"the base {name} named by {origin} is a local folder, and there is none of that name here; "
                      "give its path with --base")
    sha = recorded.get("base_sha") if recorded else None
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import validate_repo_id

    unreachable: tuple[type[BaseException], ...] = (ValueError, OSError, HfHubHTTPError, *_transport_errors())
    try:
        validate_repo_id(name)
        if not (isinstance(sha, str) and len(sha) == 40):
            sha = hashes_check.hub_sha(name, None, token)
    except unreachable as exc:  # not found, gated, unreachable, not a repo id
        why = _first(exc)
        if explicit:
            raise SourceError(f"--base {name} cannot be read ({why}); give a local folder or a Hub repo this token "
                              "can read") from None
        return None, f"the base {name} named by {origin} cannot be reached ({why})"
    return Base(name, "--base" if explicit else origin, None, sha, recorded.get("base_files") if recorded else None), ""


def _transport_errors() -> tuple[type[BaseException], ...]:
    try:
        import httpx2

        return (httpx2.TransportError,)
    except ImportError:  # pragma: no cover - huggingface_hub's own HTTP client
        return ()


def _first(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__


def component_folder(base: Base, comp: TargetComponent, target: str, token: str | None) -> Path:
    """The local folder of the base's model that ``comp`` was made from: the pipeline component of the same name
    and class, else the only one of that class, else the base itself when it is that model."""
    if base.folder is not None:
        root = base.folder
        name = _pick(root, comp, base)
        return root / name if name else root
    assert base.sha is not None
    index_root = hashes_check.fetch_base_index(base.name, base.sha, token)
    name = _pick(index_root, comp, base)
    root = hashes_check.fetch_base_component(base.name, base.sha, name, base.recorded, target, token)
    return root / name if name else root


def _pick(root: Path, comp: TargetComponent, base: Base) -> str:
    index = read_json(root, "model_index.json")
    if not index:
        return ""
    if isinstance(index.get(comp.name), list) and index[comp.name][-1] == comp.class_name:
        return comp.name
    same = [n for n, v in index.items() if not n.startswith("_") and isinstance(v, list) and v[-1] == comp.class_name]
    if len(same) != 1:
        raise SourceError(f"the base {base.display} has {len(same) or 'no'} components of class {comp.class_name}; "
                          f"pass the base of {comp.label} itself with --base")
    return same[0]


def _needs_fp8_bypass(config: Any) -> bool:
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, FqnToConfig

    configs = config.fqn_to_config.values() if isinstance(config, FqnToConfig) else [config]
    return any(isinstance(c, Float8DynamicActivationFloat8WeightConfig) for c in configs)


def requantize(comp: TargetComponent, declared: Declared, src: Path, dtype: str, device: str, base: Base) -> Any:
    """The base component loaded with the target's own quantization_config, as the target was made."""

    log.info("re-quantizing %s of %s with the declared %s (%s) for the reference", comp.label, base.display,
             declared.text, dtype)
    context = allow_cpu_float8_quantization() if device == "cpu" and _needs_fp8_bypass(declared.config) else nullcontext()
    try:
        with context:
            return load_component(comp.library, comp.class_name, src, device=device, dtype=dtype,
                                  quantization_config=declared.qconfig)
    except (AssertionError, RuntimeError, ValueError, ImportError, NotImplementedError, OSError) as exc:
        raise QuantizeError(f"re-quantizing {comp.label} of {base.display} with the declared {declared.text} failed "
                            f"({_first(exc)}); run on hardware that can quantize it, or pass --no-requantize") from exc


def compare(comp: TargetComponent, reference: Any, target: Any, src: Path, strict: str | None, what: str
            ) -> tuple[ContentCheck, bool]:
    """Every tensor of ``target`` (the loaded target) against ``reference`` (the base re-quantized): the content row
    and whether every tensor is bit-identical. ``strict``: why bit for bit is required (None: bounded where not
    bit-identical); ``what``: how the reference was made."""

    ref, got = reference.state_dict(), target.state_dict()
    check = ContentCheck(comp.name, "against the base", True, "")
    missing = sorted(set(ref) - set(got))
    extra = sorted(set(got) - set(ref))
    if missing or extra:
        name = (missing or extra)[0]
        check.ok = False
        check.detail = (f"tensor {name} is {'missing from the target' if missing else 'not in the base'} "
                        f"({len(missing)} missing, {len(extra)} extra against {what})")
        return check, False
    differing = [n for n in sorted(ref) if tensor_digest(ref[n]) != tensor_digest(got[n])]
    check.checked = len(ref)
    weights = _BaseWeights(src)
    changed = _changed_by_the_loader(ref, got, weights)
    if changed:  # the library's own loading changed it, so the re-quantization cannot show it
        check.ok = False
        check.detail = changed
        return check, False
    if not differing:
        check.detail = f"all {len(ref)} tensors bit-identical to {what}"
        return check, True
    if strict:
        check.ok = False
        check.detail = (f"tensor {differing[0]} differs from {what} ({len(differing)} of {len(ref)} tensors differ; "
                        f"bit for bit expected: {strict})")
        return check, False
    worst: tuple[float, str] = (-1.0, "")
    for name in differing:
        problem, margin, text = _bounded(name, ref[name], got[name], weights)
        if problem:
            check.ok = False
            check.detail = f"tensor {name}: {text} ({len(differing)} of {len(ref)} tensors not bit-identical to {what})"
            return check, False
        worst = max(worst, (margin, f"{name}: {text}"))
    check.detail = (f"{len(ref) - len(differing)} of {len(ref)} tensors bit-identical to {what}, {len(differing)} within "
                    f"the bound (closest to it: {worst[1]})")
    return check, False


def _changed_by_the_loader(ref: dict[str, Any], got: dict[str, Any], weights: _BaseWeights) -> str:
    """Why an unquantized tensor of the target is not the base's own (its file's), when it is not: a change the
    library made while loading (transformers' ``untie_embedding_weights`` on an untied model copies the input
    embeddings into ``lm_head``), which the re-quantization repeats and so cannot show. "" when none is."""
    import torch

    for name in sorted(got):
        t = got[name]
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or not t.is_floating_point():
            continue
        base = weights.get(name)
        if base is None or tuple(base.shape) != tuple(t.shape):
            continue  # not stored under this name (tied, renamed): nothing to compare with
        w, v = base.float(), t.detach().float()
        rel = float((v - w).norm() / w.norm().clamp_min(1e-12))
        if rel > PLAIN_BOUND:
            same = " (the base re-quantized holds it too: the library's loader changed it)" if torch.equal(
                ref[name].float(), v) else ""
            return (f"tensor {name} is not the base's own {name}: relative difference {rel:.3g} (bound "
                    f"{PLAIN_BOUND:.3g}){same}")
    return ""


class _BaseWeights:
    """The base's own tensors by name, read one at a time from its safetensors files."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self.where: dict[str, Path] = {}
        for shard in sorted(folder.glob("*.safetensors")):
            with safe_open(str(shard), framework="pt") as f:
                self.where.update({k: shard for k in f.keys()})  # noqa: SIM118  # safe_open is not a mapping

    def get(self, name: str) -> Any:
        from safetensors import safe_open

        if name not in self.where:
            return None
        with safe_open(str(self.where[name]), framework="pt") as f:
            return f.get_tensor(name)


def _values(t: Any) -> Any:
    import torch

    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return t.detach().float()
    return t.dequantize().float()


def _bounded(name: str, ref: Any, got: Any, weights: _BaseWeights) -> tuple[bool, float, str]:
    """(out of bound, how close to the bound (1.0 = on it), the figures in words) for one non-identical tensor."""
    import torch

    if type(ref) is not type(got) or tuple(ref.shape) != tuple(got.shape):
        return True, 0.0, (f"the base re-quantized is a {type(ref).__name__} {list(ref.shape)}, the target holds a "
                           f"{type(got).__name__} {list(got.shape)}")
    r, t = _values(ref), _values(got)
    if not bool(torch.isfinite(t).all()):
        return True, 0.0, "its values are not finite (NaN or inf after dequantizing)"
    quantized = type(ref) not in (torch.Tensor, torch.nn.Parameter)
    base = weights.get(name) if quantized else None
    if quantized and base is not None:
        w = base.float()
        norm = w.norm().clamp_min(1e-12)
        e_t, e_r = float((t - w).norm() / norm), float((r - w).norm() / norm)
        bound = ERROR_FACTOR * e_r + ERROR_SLACK
        text = f"quantization error {e_t:.3g} against the base's weights, the re-quantization's {e_r:.3g} (bound {bound:.3g})"
        return e_t > bound, e_t / bound, text
    limit = NO_BASE_BOUND if quantized else PLAIN_BOUND
    rel = float((t - r).norm() / r.norm().clamp_min(1e-12))
    what = "the re-quantized values" if quantized else "the base's"
    return rel > limit, rel / limit, f"relative difference {rel:.3g} from {what} (bound {limit:.3g})"

