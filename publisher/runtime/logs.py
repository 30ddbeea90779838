"""Logging for the commands: our messages and the libraries' warnings on stderr, known-harmless noise dropped.

Our modules log on ``publisher.*`` and never print. The libraries log on their own top loggers, and
torch, diffusers, transformers and huggingface_hub each add a stderr handler of their own to it when
they are imported, which would bypass any filter and print in their own formats. ``setup`` gives each
of those top loggers our one handler and keeps the library from adding its own, whether the library
is imported before or after (the stages import them lazily, and several warn while being imported).

The handler drops the records listed in ``HARMLESS`` unless ``--debug``; everything else a library
logs at WARNING or above is shown, prefixed with the logger's name. Python warnings (``warnings.warn``) keep
Python's own display, except the known-harmless ones ``filter_warnings`` hides. Not covered: torch's torch.compile
sub-loggers (``torch._dynamo``, ``torch._inductor`` ...), which keep their own handlers; we do not compile. Progress
bars: runtime/progress.py.
"""

from __future__ import annotations

import logging
import re
import sys
from dataclasses import dataclass
from typing import TextIO

LIBRARIES = ("torch", "torchao", "diffusers", "transformers", "huggingface_hub")


@dataclass(frozen=True)
class Harmless:
    """A library message we know to be harmless for this tool: dropped unless --debug."""

    logger: str  # the logger the record is made on (exactly)
    pattern: str  # regular expression searched in the message
    why: str  # shown nowhere: the reason it may be hidden, for whoever reviews this list
    card: str = ""  # how the card names it to whoever runs its snippets, who sees it unfiltered ("": they do not)
    kinds: tuple[str, ...] = ("pipeline", "transformers")  # the cards (plan kinds) whose snippets print it


HARMLESS: tuple[Harmless, ...] = (
    Harmless(
        "torchao", r"^Failed to load \S*_C_(mxfp8|cutlass_90a)\S*\.so",
        "torchao's optional MX-FP8 (prototype) and CUTLASS sm90a sparse-FP8 kernel libraries; the wheel ships "
        "them built for another Python or CUDA, and no recipe of ours calls them (our FP8 matmuls are "
        "torch._scaled_mm). Any other torchao library that fails to load is still shown.",
        card="torchao's `Failed to load .../torchao/_C_mxfp8...so` and `..._C_cutlass_90a...so` (optional kernels that "
             "no recipe of this tool calls)",
    ),
    Harmless(
        "torchao.kernel.intmm", r"Detected no triton",
        "Triton backs torchao's optional int_mm autotuner only (off unless TORCHAO_AUTOTUNER_ENABLE=1); "
        "CPU builds of torch have no Triton and our CPU recipes do not need it.",
    ),
    Harmless(
        "torch.utils._pytree", r"is an Enum subclass .*register_constant\(\) on Enum subclasses is deprecated",
        "torchao 0.18 registers its enums (KernelPreference, ScaleCalculationMode) as pytree constants at "
        "import; a deprecation addressed to torchao that changes nothing in the tensors we write or read.",
        card="torch's `Calling register_constant() on Enum subclasses is deprecated` (addressed to torchao)",
    ),
    Harmless(
        "diffusers.quantizers.torchao.torchao_quantizer", r"Unable to import `torchao` Tensor objects",
        "diffusers adds torchao's old tensor classes (NF4Tensor, UintxTensor ...) to torch.load's weights_only "
        "allow-list for pickled .bin checkpoints; torchao 0.18 removed them. We write and read safetensors "
        "only, which never goes through torch.load.",
        card="diffusers' `Unable to import torchao Tensor objects` (about pickled .bin checkpoints; this repo is "
             "safetensors)", kinds=("pipeline",),
    ),
    Harmless(
        "transformers.utils.import_utils", r"requires torchvision \(not installed\); falling back to `\w+Pil`",
        "a pipeline's image processors (FLUX's CLIP and SigLIP ones, for image prompts) are loaded with it; without "
        "torchvision transformers gives the PIL implementation of the same processor. No stage of ours runs an image "
        "processor, and torchvision must match the torch build exactly: not a dependency worth adding for a log line.",
        card="without torchvision, transformers' `CLIPImageProcessor requires torchvision` and `SiglipImageProcessor "
             "requires torchvision` (the same for any image processor: it falls back to its PIL version)",
        kinds=("pipeline",),
    ),
    Harmless(
        "huggingface_hub.hf_api", r"^No files have been modified since last commit\. Skipping to prevent empty commit",
        "--force over a target whose files are all the same as ours: the client sends no empty commit, and our own "
        "lines say so (stages/push.py and the CLI's summary).",
    ),
)


_COMPILED = [(h.logger, re.compile(h.pattern)) for h in HARMLESS]


def card_lines(kind: str) -> list[str]:
    """The harmless lines a card names to whoever runs its snippets (plan kind "pipeline" or "transformers")."""
    return [h.card for h in HARMLESS if h.card and kind in h.kinds]


def is_harmless(record: logging.LogRecord) -> bool:
    """True when ``record`` is one of the HARMLESS library messages."""
    return any(record.name == name and rx.search(record.getMessage()) for name, rx in _COMPILED)


class _Format(logging.Formatter):
    """Our messages as they are; a library's prefixed with its logger's name (where to look it up)."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # logging's name
        if record.name == "publisher" or record.name.startswith("publisher."):
            return record.message
        return f"{record.name}: {record.message}"


class _Stderr(logging.StreamHandler):
    """Writes to the current ``sys.stderr`` (click's test runner swaps it); drops HARMLESS unless --debug."""

    def __init__(self, show_harmless: bool) -> None:
        super().__init__()
        self.show_harmless = show_harmless
        self.setFormatter(_Format())

    @property
    def stream(self) -> TextIO:  # the attribute logging.StreamHandler writes to
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:  # StreamHandler.__init__ assigns it; we always use sys.stderr
        pass

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.show_harmless and is_harmless(record):
            return False
        return bool(super().filter(record))


class _LibraryLogger(logging.Logger):
    """A library's top logger whose records go to our handler only.

    torch, diffusers, transformers and huggingface_hub call ``addHandler`` (and set ``propagate``) on
    their top logger while being imported; those calls are ignored here, so it makes no difference
    whether a stage imports them before or after ``setup``."""

    def addHandler(self, hdlr: logging.Handler) -> None:  # logging's name
        if isinstance(hdlr, _Stderr):
            super().addHandler(hdlr)

    @property
    def propagate(self) -> bool:  # never to the root: our handler is here
        return False

    @propagate.setter
    def propagate(self, value: bool) -> None:
        pass


def setup(*, debug: bool = False, quiet: bool = False) -> None:
    """Route ``publisher.*`` and the LIBRARIES' logging to one stderr handler.

    Ours at INFO (DEBUG with ``debug``, WARNING with ``quiet``); the libraries at their own level
    (WARNING by default). Call before the stages import torch: torchao and diffusers warn at import."""
    handler = _Stderr(show_harmless=debug)
    if not debug:
        filter_warnings()
    ours = logging.getLogger("publisher")
    ours.handlers[:] = [handler]
    ours.setLevel(logging.DEBUG if debug else logging.WARNING if quiet else logging.INFO)
    for name in LIBRARIES:
        lib = logging.getLogger(name)
        if type(lib) is logging.Logger:
            lib.__class__ = _LibraryLogger  # see _LibraryLogger: the library's own handlers are refused from now on
        lib.handlers[:] = [handler]


# What a module's warnings are matched on: its name for a warning raised at run time (torchao.quantization.quant_api),
# its file without ".py" for one raised while Python compiles it (.../site-packages/torchao/quantization/quant_api).
TORCHAO_MODULE = r"(.*[\\/])?torchao([\\/.]|$)"


def filter_warnings() -> None:
    """The libraries' known-harmless Python warnings (``warnings.warn``, not logging), hidden unless --debug. Set before
    torchao is imported: the escape-sequence warning is raised while its source is compiled."""
    import warnings

    # torchao 0.18 warns at every FqnToConfig with "_default", which per-layer repos need (the card says so)
    warnings.filterwarnings("ignore", message=r"Config Deprecation: _default is deprecated", category=UserWarning)
    # torchao 0.18's quant_api.py has a docstring with "\." that is not a raw string: a SyntaxWarning under Python 3.12+,
    # a DeprecationWarning before (shown with -W default), printed the first time the file is compiled to bytecode
    for category in (SyntaxWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", message=r"invalid escape sequence", category=category, module=TORCHAO_MODULE)
