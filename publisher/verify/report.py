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
REPORT_NAME = "verification.json"


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
    expected: list[Expected] = field(default_factory=list, repr=False)  # kept for the post-push check, not serialised

    def to_dict(self) -> dict[str, Any]:
        data = asdict(replace(self, expected=[]))
        data.pop("expected")
        return data

    def write(self, folder: Path) -> Path:
        path = folder / REPORT_NAME
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path

    def failures(self) -> list[PathResult]:
        return [r for r in self.results if not r.ok]

    def summary(self) -> str:
        bad = self.failures()
        if not bad:
            return f"{len(self.results)} load checks passed"
        first = bad[0]
        return f"{first.component or 'model'} via the {first.path} path ({first.env}): {first.detail}"


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


def require_passed(report: VerifyReport) -> None:
    if not report.passed:
        raise VerificationError(f"verification of {report.recipe} failed: {report.summary()}; nothing was pushed")
