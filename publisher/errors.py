"""The library's error family. The CLI turns these (and huggingface_hub's) into one-line messages.

Every message names the thing that failed and the fix, so it can be shown to a user as is.
"""

from __future__ import annotations

import signal
from typing import Generic, TypeVar

R = TypeVar("R")


class PublishError(Exception):
    """Base class: anything the user can act on. Exit code 1 unless a subclass says otherwise."""

    exit_code = 1


class UsageError(PublishError):
    """Bad command-line input detected after parsing (malformed id, unknown recipe...). Exit 2."""

    exit_code = 2


class HardwareError(PublishError):
    """The recipe cannot be made on this machine (e.g. int4wo needs a CUDA GPU with compute capability >= 8.0)."""


class SourceError(PublishError):
    """The base model cannot be used: missing, gated, wrong layout, unknown component..."""


class InputError(PublishError):
    """A file we read is malformed or unsafe: JSON that is not an object or over its size limit, a safetensors
    header the safetensors library would refuse, a link that leaves the base folder, a special file.

    ``kind`` names the rule that failed (for safetensors headers: the class of the library's own error), so
    tests can compare classes without parsing messages."""

    def __init__(self, message: str, kind: str = "") -> None:
        super().__init__(message)
        self.kind = kind


class TargetError(PublishError):
    """The target repo or output folder cannot be written."""


class IntegrityError(SourceError):
    """Bytes of the base (or of a target) differ from the hash the Hub reports for that file."""


class QuantizeError(PublishError):
    """Quantization or saving failed."""


class VerificationError(PublishError):
    """The saved result does not reload, or differs from the in-memory quantized model."""


class QualityError(PublishError):
    """A quality figure fell below its --min-quality bound (or could not be measured for it): nothing is pushed."""


class ResourceError(PublishError):
    """Not enough disk or memory for the plan."""


class RunFailed(PublishError, Generic[R]):
    """A publish run stopped by ``cause``; ``results`` is what each recipe had come to (for --json).

    The CLI explains ``cause`` (it is also ``__cause__``), and prints ``results`` when asked for JSON."""

    def __init__(self, cause: BaseException, results: list[R]) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.results = results
        self.exit_code = getattr(cause, "exit_code", 1)


class EnvBuildError(PublishError):
    """A verification environment given as a version spec (--verify-env diffusers==0.39.0) cannot be built."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the run. A KeyboardInterrupt, so that ``except Exception`` never swallows it and every
    ``finally`` / ``except BaseException`` cleanup runs on the way out. Exit code 128 + the signal number (130, 143).

    ``left``: what the run keeps on purpose (e.g. the resume cache), said in the one-line message; ``resume``: how to
    go on."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.left: list[str] = []
        self.resume = "re-run the same command"
        super().__init__(self.signal_name)

    @property
    def signal_name(self) -> str:
        try:
            return signal.Signals(self.signum).name
        except ValueError:
            return f"signal {self.signum}"

    @property
    def exit_code(self) -> int:
        return 128 + self.signum
