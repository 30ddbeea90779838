"""The demo's serve mode (`make demo-serve`): the lines it prints point a shell at its Hub, and the card's snippets
are written out as it shows them. The demo itself (a whole publish) is what `make demo` runs; not repeated here."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from publisher.testing import demo

ROOT = Path(__file__).resolve().parents[1]


def test_the_environment_lines_reach_the_demo_hub(tmp_path: Path) -> None:
    lines = demo.environment_lines("http://127.0.0.1:4321", tmp_path)
    assert lines[:2] == ["export HF_ENDPOINT=http://127.0.0.1:4321",
                         f"export HF_HUB_CACHE={tmp_path / 'hf_home' / 'hub'}"]  # never the user's own cache
    assert not any("HF_HUB_DISABLE_XET" in line for line in lines)  # the demo's Hub serves Xet, as the Hub does
    token = lines[2].split()[1].split("=", 1)[1]
    assert lines[2].startswith("export HF_TOKEN=") and demo.DEMO_TOKENS[token] == "demo-user"  # whom the CLI publishes as


def test_the_card_snippets_are_written_in_order(tmp_path: Path) -> None:
    files = demo.write_snippets(ROOT / "tests" / "golden" / "flux-int8wo.md", tmp_path / "snippets")
    assert [f.name for f in files] == ["1-config.py", "2-usage.py", "3-offload.py", "4-compile.py", "5-manual-load.py"]
    assert "DiffusionPipeline.from_pretrained(" in files[1].read_text()
    manual = files[4].read_text()  # the golden card's first quantized component: its T5 text encoder (transformers)
    assert "load_into(model, convert_checkpoint_keys(model, read_checkpoint(folder)))" in manual
    for f in files:
        compile(f.read_text(), str(f), "exec")


def test_make_demo_serve_runs_the_demo_in_serve_mode() -> None:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    proc = subprocess.run(["make", "-n", "--no-print-directory", "-C", str(ROOT), "demo-serve"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1].endswith("-m publisher.testing.demo --serve")
