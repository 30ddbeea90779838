"""action/disk.py: the opt-in free-disk step acts on GitHub-hosted Linux runners only."""

from __future__ import annotations

from pathlib import Path

import pytest

from action.disk import free_disk


def test_free_disk_space(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    victim = tmp_path / "dotnet"
    (victim / "sdk").mkdir(parents=True)
    env = {"HFAO_FREE_DISK_SPACE": "true", "RUNNER_ENVIRONMENT": "self-hosted", "RUNNER_OS": "Linux"}
    assert free_disk(env, paths=[str(victim)]) == 0
    assert victim.exists() and "only acts on GitHub-hosted" in capsys.readouterr().out  # never on a self-hosted machine
    assert free_disk({**env, "HFAO_FREE_DISK_SPACE": "false", "RUNNER_ENVIRONMENT": "github-hosted"}, paths=[str(victim)]) == 0
    assert victim.exists()
    assert free_disk({**env, "RUNNER_ENVIRONMENT": "github-hosted"}, paths=[str(victim), str(tmp_path / "absent")]) == 0
    assert not victim.exists()
    out = capsys.readouterr().out
    assert "::group::Free disk space" in out and "::endgroup::" in out
