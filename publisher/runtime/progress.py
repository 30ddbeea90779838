"""Progress bars, ours and the libraries': drawn only when stderr is a terminal, never with --quiet.

huggingface_hub (downloads, uploads, hf_xet's "Processing Files" and "New Data Upload"), transformers ("Loading
weights", "Writing model shards") and diffusers ("Loading pipeline components") draw tqdm bars on stderr whether or not
it is a terminal; in a CI log each redraw is another line of escape codes. ``setup`` decides once per command, before
a stage imports them: with bars off, our stage lines (one per stage or file) are what a log shows.

Off means two variables in this process's environment, both read when the library is imported, and inherited by the
processes a run starts (verification workers, measurements):

- ``HF_HUB_DISABLE_PROGRESS_BARS=1``: huggingface_hub's bars and hf_xet's, and transformers' (it starts from it);
- ``TQDM_DISABLE=1``: tqdm's own default for ``disable`` (tqdm >= 4.66), which covers diffusers' bars: diffusers has
  no variable of its own.

A library imported before ``setup`` (an in-process caller: the tests' CLI runner) is switched off by its own function.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO

_shown = False  # what setup decided; our own bars (the streaming engine's, verification's) follow it


def wanted(quiet: bool, stream: TextIO) -> bool:
    """Bars on ``stream``: only on a terminal, and never with --quiet."""
    if quiet:
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty())


def setup(*, quiet: bool, stream: TextIO | None = None) -> bool:
    """Decide for this command (``stream``: default the current stderr) and switch the libraries' bars off where they
    are not wanted. Returns the decision; ``shown()`` gives it later."""
    global _shown
    _shown = wanted(quiet, sys.stderr if stream is None else stream)
    if not _shown:
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        os.environ["TQDM_DISABLE"] = "1"
        _switch_off_imported()
    return _shown


def shown() -> bool:
    """Whether our own bars are drawn (False until ``setup`` says otherwise: library callers pass theirs)."""
    return _shown


def _switch_off_imported() -> None:
    """Libraries imported before ``setup`` have read the variables already: their own switches turn them off."""
    if "huggingface_hub" in sys.modules:
        from huggingface_hub import constants
        from huggingface_hub.utils import disable_progress_bars

        if constants.HF_HUB_DISABLE_PROGRESS_BARS is not False:  # set to 0 at its import: it would only warn
            disable_progress_bars()
    transformers_logging = sys.modules.get("transformers.utils.logging")
    if transformers_logging is not None:
        transformers_logging.disable_progress_bar()
    diffusers_logging = sys.modules.get("diffusers.utils.logging")
    if diffusers_logging is not None:
        diffusers_logging.disable_progress_bar()
