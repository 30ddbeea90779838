"""How the suite spreads over the xdist workers: which files are spread test by test (SPREAD), and the order their work
is handed out in (COST_ORDER). tests/conftest.py's hooks call ``make_scheduler`` and ``order``; nothing here is a hook.

`make test` runs `--dist loadscope`, with the scheduler below: a test file stays on one worker (its module-scoped
fixtures, a publish or a corpus, are built once), as `--dist loadfile` kept every file, except the files named in
SPREAD, which share nothing but session fixtures (each worker builds its own): their tests go one by one to whichever
worker is free (before, the 25 family publishes sat on one worker). xdist's own `loadgroup` marks do not take effect
with pytest 9 (the group suffix it writes into a test's node id is not read back), hence a scheduler.
tests/test_makefile.py checks that every name in both lists is a test file of tests/.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SPREAD = {"test_families", "test_job", "test_hub", "test_cli", "test_publish_configs", "test_family_failures",
          "test_hfjobs_e2e", "test_action", "test_one_pass", "test_signals", "test_quality_e2e", "test_local_inputs",
          "test_docs_commands", "test_quality_defaults"}
# Files in the order their work is handed out, the costliest first (seconds on 2 cores, `--durations` of a full run), so
# that no long test starts last and leaves the other worker idle; files not named here follow, in their usual order.
# Every file of more than a few seconds is named: test_zygotes (some 30 s on one worker), which came last by name,
# left the other worker idle for half a minute at the end of the run; test_prestarted (some 45 s alone) beside it.
# test_verify_matrix as on a fresh clone (its environments built from PyPI: 30 s more than from the cache).
# The docs' commands first (minutes of publishes with the product's defaults, spread test by test); the Action's
# workflows (docs/action.md, one test of a few minutes) after them, so that their publishes of the same bases and
# recipes read the compatibility loads the commands measured (verify/memo.py) instead of measuring them again.
COST_ORDER = ["test_docs_commands", "test_families", "test_stages_card", "test_docs_action", "test_quality_defaults",
              "test_verify_full", "test_hfjobs_e2e", "test_job",
              "test_hub", "test_cli", "test_signals", "test_quality_e2e", "test_verify_matrix", "test_action",
              "test_scripts_gpu_check", "test_zygotes", "test_prestarted", "test_zygote_layers", "test_verify_streaming", "test_one_pass", "test_streaming_convert",
              "test_verify_peers", "test_testing_tiny", "test_integrity", "test_hostile_input", "test_hf_extension",
              "test_testing_hubserver", "test_publish_configs", "test_cli_bad_input", "test_action_run",
              "test_family_failures", "test_verify_envs"]


def module(nodeid: str) -> str:
    """The test file's name without ``.py`` (``test_hub``) of a node id."""
    return Path(nodeid.split("::", 1)[0]).stem


def scope(nodeid: str) -> str:
    """The unit of work one worker takes: the test, in the files of SPREAD; else its whole file."""
    return nodeid if module(nodeid) in SPREAD else nodeid.split("::", 1)[0]


def make_scheduler(config: Any, log: Any) -> Any:
    """--dist loadscope with a scope per file, or per test for the files in SPREAD; None (xdist's own) otherwise."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    # xdist would hand out the files with the most tests first, which puts the one-test scopes (the family publishes)
    # last; keep the collection's order, the costliest first (``order``)
    config.option.loadscopereorder = False

    class FileOrTestScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:  # the hook LoadScopeScheduling's subclasses override (loadfile's too)
            return scope(nodeid)

    return FileOrTestScheduling(config, log)


def order(items: list[Any]) -> None:
    """Sort the collected items, in place, by COST_ORDER (a stable sort: a file's tests keep their order)."""
    rank = {name: i for i, name in enumerate(COST_ORDER)}
    items.sort(key=lambda item: rank.get(module(item.nodeid), len(rank)))
