"""action/workflow.py: workflow commands, masks and step outputs, read back the way the runner reads them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from action_harness import Command, parse_commands, parse_output_file

from action.workflow import command, commands_stopped, group, mask, redact, write_output


def test_output_heredoc_roundtrip(tmp_path: Path) -> None:
    path = tmp_path / "out"
    tricky = 'line1\nname=injected\nEOF\n"$(touch x)"\n'
    write_output(str(path), "a", tricky)
    write_output(str(path), "b", "")
    write_output(str(path), "c", "plain")
    assert parse_output_file(path) == {"a": tricky, "b": "", "c": "plain"}
    assert re.search(r"^a<<ghadelimiter_[0-9a-f]{32}$", path.read_text(), re.M)


def test_commands_are_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    command("error", "100% bad\n::add-path::/evil", title="a:b,c")
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and "%25" in line and "%0A::add-path" in line
    assert parse_commands(line) == [Command("error", {"title": "a:b,c"}, "100% bad\n::add-path::/evil")]


def test_multiline_secret_is_masked_and_redacted_line_by_line(capsys: pytest.CaptureFixture[str]) -> None:
    mask("tok_one\n  tok_two \n\n")
    assert capsys.readouterr().out == "::add-mask::tok_one\n::add-mask::tok_two\n"
    assert redact("a tok_one b tok_two", ["tok_one\ntok_two"]) == "a *** b ***"


def test_stopped_commands_and_groups_resume_on_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RuntimeError), group("g"), commands_stopped():
        print("::add-path::/evil")
        raise RuntimeError
    out = capsys.readouterr().out
    assert parse_commands(out) == [Command("group", {}, "g"), Command("endgroup", {}, "")]
    token = re.search(r"^::stop-commands::([0-9a-f]{32})$", out, re.M)
    assert token and f"::{token.group(1)}::\n::endgroup::" in out
