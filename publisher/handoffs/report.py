"""The verification report and what every reload must reproduce: the types every verify module shares.

Kept apart from the code that produces them so that full reloads (full.py), streaming checks (streaming.py),
checks of a pushed commit (published.py) and `verify TARGET` (target.py) depend on these types, not on each other.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from publisher.errors import VerificationError

PATHS = ("library", "manual")
MODES = ("auto", "full", "streaming")
Mode = Literal["auto", "full", "streaming"]
# pass: bit-identical, every planned layer of the class its config implies; fail: something raised (the load, moving
# the model, its forward); silently wrong: nothing raised, but layers are not quantized as declared, or tensors /
# outputs differ or are not finite (the dangerous one)
Outcome = Literal["pass", "fail", "silently wrong"]
OUTCOMES: tuple[Outcome, ...] = ("pass", "fail", "silently wrong")
REPORT_NAME = "verification.json"
PLAIN_CLASSES = ("Parameter", "Tensor")  # a Linear weight's class when it is not a torchao tensor


@dataclass
class PathResult:
    component: str
    path: str  # "library" | "manual"
    env: str  # "current" or the interpreter given with --verify-env
    versions: dict[str, str]
    ok: bool
    detail: str = ""
    max_abs_diff: float | None = None
    quantized_layers: int = 0
    tensors_checked: int = 0
    forward_checked: bool = False
    applicable: bool = True  # False: this path does not apply to the model (detail says why); not a failure
    silent: bool = False  # True only for a silently wrong load: nothing raised, and it is wrong (see Outcome)
    class_found: str = ""  # the class(es) the planned layers came back as, most frequent first
    classes_found: dict[str, int] = field(default_factory=dict)  # class -> planned layers of it

    @property
    def outcome(self) -> Outcome:
        return "pass" if self.ok else "silently wrong" if self.silent else "fail"


@dataclass
class EnvRecord:
    """One environment of the compatibility matrix, as it was measured."""

    name: str  # "current", the spec (diffusers==0.38.0) or the interpreter's path
    kind: Literal["current", "spec", "interpreter", "recheck"]  # recheck: the environment of `hf-ao-publish recheck`
    gating: bool  # True: must pass for a publish (this environment, --verify-env); False: measured for the card
    packages: dict[str, str] = field(default_factory=dict)  # what a spec's layer holds, exact versions
    why: str = ""  # why the default matrix runs it
    build_seconds: float | None = None  # None: not built by this run (reused, or not a spec)
    newest: bool = False  # a package replaced by its newest release on the index, looked up when the run started
    unusable: str = ""  # why nothing loads there at all (torch cannot import torchao): one failing row, no loads run
    skipped: str = ""  # a newest release not measured (not looked up, or not buildable here), said in one line


@dataclass
class ContentCheck:
    """One check of what a component's files hold (``verify TARGET``): the declared config against the stored
    tensors, the stored values (finite), or the tensors against the base re-quantized."""

    component: str
    what: str  # "declared config" | "stored values" | "against the base"
    ok: bool
    detail: str
    notes: list[str] = field(default_factory=list)  # facts that do not fail the check (layers not checked, and why)
    checked: int = 0  # layers (or tensors) checked


@dataclass
class Quality:
    component: str
    rel_error: float
    cosine: float


@dataclass
class VerifyReport:
    recipe: str
    location: str
    passed: bool
    results: list[PathResult] = field(default_factory=list)
    quality: list[Quality] = field(default_factory=list)
    expected_layers: dict[str, int] = field(default_factory=dict)
    tensor_class: str = ""
    device: str = "cpu"
    mode: Mode = "full"  # "full": whole reloads in fresh processes; "streaming": tensor by tensor + block by block
    notes: list[str] = field(default_factory=list)
    forward: dict[str, ForwardInputs] = field(default_factory=dict)  # component label -> the inputs of its forward check
    compat: list[PathResult] = field(default_factory=list)  # the matrix's results (publisher/verify/matrix.py)
    environments: list[EnvRecord] = field(default_factory=list)  # every environment measured, gating ones first
    compat_note: str = ""  # why no matrix ran ("--compat none", streaming verification), when none did
    content: list[ContentCheck] = field(default_factory=list)  # verify TARGET: what the files hold
    values: str = ""  # verify TARGET: what the tensors' values were compared with (the base, or only each other)
    self_consistency_only: bool = False  # verify TARGET: no base, values only checked for self-consistency
    base: str | None = None  # verify TARGET: the base compared with
    expected: list[Expected] = field(default_factory=list, repr=False)  # kept for the post-push check, not serialised

    def to_dict(self) -> dict[str, Any]:
        data = asdict(replace(self, expected=[], forward={}))
        data.pop("expected")
        data["forward"] = {c: f.to_dict() for c, f in self.forward.items()}
        for key in ("results", "compat"):
            for item, result in zip(data[key], getattr(self, key)):
                item["outcome"] = result.outcome
        return data

    def write(self, folder: Path) -> Path:
        path = folder / REPORT_NAME
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path

    def failures(self) -> list[PathResult]:
        return [r for r in self.results if not r.ok and r.applicable]

    def content_failures(self) -> list[ContentCheck]:
        return [c for c in self.content if not c.ok]

    def weights_only(self) -> dict[str, str]:
        """Components whose outputs were not compared (no forward pass), with why."""
        return {c: f.reason or "no forward inputs" for c, f in self.forward.items() if f.file is None}

    def summary(self) -> str:
        content = self.content_failures()
        if content:  # what the files hold is the most precise answer
            return f"{content[0].component or 'model'}: {content[0].detail}"
        bad = self.failures()
        if not bad:
            return f"{len(self.results)} load checks passed"
        first = bad[0]
        loud = "silently wrong: " if first.outcome == "silently wrong" else ""
        return f"{first.component or 'model'} via the {first.path} path ({first.env}): {loud}{first.detail}"

    def compat_counts(self) -> str:
        """``3 pass, 2 fail, 1 silently wrong`` over the compatibility matrix's loads."""
        return ", ".join(f"{n} {o}" for o in OUTCOMES if (n := sum(1 for r in self.compat if r.outcome == o)))


@dataclass
class ForwardInputs:
    """The inputs of one component's forward check: a saved call (loadpath.save_call), or none and why."""

    file: Path | None
    how: str  # what the inputs are, for the card and --json
    reason: str | None = None  # why there is no forward check (weights only)

    def to_dict(self) -> dict[str, Any]:
        return {"inputs": self.how if self.file else None, "weights_only": self.file is None, "reason": self.reason}


@dataclass
class Expected:
    """What every reload of one component must reproduce."""

    component: str
    library: str
    class_name: str
    inputs: Path | None
    output: Any
    digests: dict[str, str]
    quantized: list[str]
    reference: str = "the in-memory quantized model"
    classes: dict[str, str] = field(default_factory=dict)  # layer -> the class its config implies (else the recipe's)
    dtype: str = "bfloat16"  # the dtype every load path loads the component in
    needs_reference: bool = False  # streamed component: the first library-path reload gives the reference output
    base_output: Any = None  # the bf16 base's output on the same inputs, when the quantization pass computed it


@dataclass
class PassForward:
    """The forward passes run during the quantization pass (verify/inpass.py): the quantized tensors and the bf16
    ones, block by block as the engine read them. ``output`` is None when they could not run (``detail`` says why)."""

    output: Any = None  # the quantized component's output
    base_output: Any = None  # the bf16 base's output
    blocks: int = 0  # block loads of the quantized forward
    peak_block_bytes: int = 0
    detail: str = ""
    cpu_seconds: float = 0.0  # both forward threads' CPU time


def require_passed(report: VerifyReport) -> None:
    if not report.passed:
        raise VerificationError(f"verification of {report.recipe} failed: {report.summary()}; nothing was pushed")
