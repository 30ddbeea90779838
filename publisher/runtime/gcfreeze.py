"""The cyclic garbage collector around the libraries' imports.

Importing torch, torchao, diffusers and transformers makes the objects of some 3,000 modules, and every full
collection afterwards walks them all again. ``frozen_after()`` pauses the collector while its block runs (the block
that first imports them) and then freezes what is alive (``gc.freeze``): later collections skip those objects, which
live as long as the process anyway. Garbage made later is collected as usual. A tiny publish in a fresh process
spends a quarter less CPU time (5.4 s -> 4.1 s, measured); publisher/loadpath.py does the same for its own imports
(it imports nothing of ours).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen_after() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        # the block's garbage first: a frozen reference cycle is never freed, with whatever it holds (torch.fx.wrap
        # leaves its frame in one, and a frame holds its callers' frames and their variables)
        gc.collect()
        if was:
            gc.enable()
        gc.freeze()
