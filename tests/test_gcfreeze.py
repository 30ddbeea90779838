"""publisher/runtime/gcfreeze.py: the cyclic GC paused around a block, then what is alive frozen out of collections."""

from __future__ import annotations

import gc

import pytest

from publisher.runtime.gcfreeze import frozen_after


class Made:
    pass


def test_the_collector_is_paused_inside_and_what_is_alive_is_frozen_after() -> None:
    before = gc.get_freeze_count()
    with frozen_after():
        assert not gc.isenabled()
        kept = [Made() for _ in range(100)]
    assert gc.isenabled() and gc.get_freeze_count() >= before + len(kept)
    loop: list[object] = []
    loop.append(loop)  # garbage made afterwards is collected as usual
    del loop
    assert gc.collect() >= 1


def test_an_error_inside_still_restores_the_collector_and_a_disabled_one_stays_disabled() -> None:
    with pytest.raises(KeyError), frozen_after():
        raise KeyError("x")
    assert gc.isenabled()
    gc.disable()
    try:
        with frozen_after():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
