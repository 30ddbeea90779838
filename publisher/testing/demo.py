"""Offline demo: a loopback Hub, a tiny FLUX pipeline seeded on it, published with --quant int8wo, loaded back.

    python -m publisher.testing.demo [--workdir demo-output] [--recipe int8wo] [--serve]

Nothing leaves this machine: the Hub is publisher.testing.hubserver on 127.0.0.1, and the real
huggingface_hub client, the real CLI (as a subprocess) and diffusers talk to it via HF_ENDPOINT.
``--serve`` (`make demo-serve`) keeps that Hub serving after the demo, until Ctrl-C, and prints the environment
lines that point a shell at it, so the published card's snippets (written to WORKDIR/snippets/) run as written.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

DEMO_TOKENS = {"demo-token-bfl": "black-forest-labs", "demo-token-you": "demo-user"}
YOUR_TOKEN = "demo-token-you"  # the demo's user, demo-user: the CLI publishes with it


def environment_lines(url: str, work: Path) -> list[str]:
    """What a shell needs to use the demo's Hub as the card's snippets do: the endpoint (read by huggingface_hub at
    import; the loopback Hub serves Xet as huggingface.co does, so nothing else changes), a cache of its own (the
    demo's repo ids must not land in your real Hugging Face cache), and the token of the demo's user for publishing
    more to it."""
    return [f"export HF_ENDPOINT={url}",
            f"export HF_HUB_CACHE={work / 'hf_home' / 'hub'}",
            f"export HF_TOKEN={YOUR_TOKEN}  # only to publish to it, as demo-user: reading the demo's repos needs none"]


SNIPPET_KINDS = [("enable_model_cpu_offload()", "offload"), ("torch.compile(", "compile"), ("read_checkpoint(", "manual-load"),
                 ("quantization_config = ", "config"), ("from_pretrained(", "usage"), ("Config(", "config")]


def card_snippets(text: str) -> list[tuple[str, str]]:
    """The card's Python snippets in order, each as (what it does, its code): config, usage, offload, compile,
    manual-load (the config block names from_pretrained only in a comment, so it is told apart first)."""
    return [(next((kind for marker, kind in SNIPPET_KINDS if marker in code), "snippet"), code)
            for code in re.findall(r"```python\n(.*?)```", text, flags=re.S)]


def write_snippets(card: Path, folder: Path) -> list[Path]:
    """The card's Python snippets, one file each, in the order of the card, each named by what it does."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i, (kind, code) in enumerate(card_snippets(card.read_text())):
        path = folder / f"{i + 1}-{kind}.py"
        path.write_text(code)
        out.append(path)
    return out


def _serve(hub: Any, work: Path, snippets: list[Path]) -> None:
    """Keep the Hub serving until Ctrl-C (or SIGTERM), after printing how to reach it."""
    python = Path(sys.executable)
    lines = ["", f"[demo] the local Hub keeps serving at {hub.url} until Ctrl-C. To run the card's snippets, paste these "
             "lines in another shell:", "", *environment_lines(hub.url, work), "",
             *(f"{python} {path}" for path in snippets), ""]
    print("\n".join(lines), file=sys.stderr, flush=True)

    def _stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("[demo] stopped the local Hub", file=sys.stderr)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("demo-output"))
    parser.add_argument("--recipe", default="int8wo")
    # The compatibility matrix builds environments from PyPI; the demo stays offline unless asked
    # (`--compat default`: the card then gets the measured Compatibility table).
    parser.add_argument("--compat", default="none")
    parser.add_argument("--serve", action="store_true", help="keep the local Hub serving after the demo, until Ctrl-C")
    args = parser.parse_args(argv)

    work = args.workdir.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    port = _free_port()
    # Must be set before huggingface_hub is imported (it reads them at import time).
    os.environ.update({
        "HF_ENDPOINT": f"http://127.0.0.1:{port}",
        "HF_HOME": str(work / "hf_home"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        # a few MB move: no progress bars from huggingface_hub and transformers, here or in the CLI's process
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    })
    os.environ.pop("HF_TOKEN", None)
    from publisher.runtime import logs

    logs.setup(quiet=True)  # the libraries' known-harmless lines are hidden here too, as in the CLI

    from huggingface_hub import HfApi

    from publisher.testing.hubserver import HubServer
    from publisher.testing.tiny import build_tiny_flux

    with HubServer(work / "hub-data", tokens=DEMO_TOKENS, port=port) as hub:
        print(f"[demo] local Hub at {hub.url}", file=sys.stderr)
        base = build_tiny_flux(work / "tiny-flux")
        api = HfApi(token="demo-token-bfl")
        api.create_repo("black-forest-labs/FLUX.1-tiny")
        api.upload_folder(repo_id="black-forest-labs/FLUX.1-tiny", folder_path=base, commit_message="tiny FLUX pipeline")
        print("[demo] seeded black-forest-labs/FLUX.1-tiny", file=sys.stderr)

        out_dir = work / "published"
        cmd = ["hf-ao-publish", "black-forest-labs/FLUX.1-tiny", "--quant", args.recipe, "--output-dir", str(out_dir),
               "--sample-steps", "2", "--sample-size", "64", "--compat", args.compat, "--json"]
        exe = shutil.which("hf-ao-publish") or str(Path(sys.executable).with_name("hf-ao-publish"))
        print(f"[demo] $ {' '.join(cmd)}", file=sys.stderr)
        env = {**os.environ, "HF_TOKEN": YOUR_TOKEN}
        proc = subprocess.run([exe, *cmd[1:]], env=env, stdout=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            print(f"[demo] hf-ao-publish failed with exit code {proc.returncode}", file=sys.stderr)
            return proc.returncode
        result = json.loads(proc.stdout)

        import torch
        from diffusers import DiffusionPipeline
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()  # "Loading pipeline components..."
        pipe = DiffusionPipeline.from_pretrained(result["repo_id"], dtype=torch.bfloat16)
        pipe.set_progress_bar_config(disable=True)
        weight = pipe.transformer.transformer_blocks[0].attn.to_q.weight
        image = pipe("a photo of a cat", num_inference_steps=2, height=64, width=64,
                     generator=torch.Generator().manual_seed(0)).images[0]
        image.save(work / "sample.png")
        print(f"[demo] loaded {result['repo_id']} back from the Hub: transformer weights are {type(weight).__name__}; "
              f"2-step sample saved to {work / 'sample.png'}", file=sys.stderr)
        snippets = write_snippets(out_dir / "README.md", work / "snippets")
        print(f"card: {out_dir / 'README.md'}")
        print(f"repo: {result['url']}")
        print(f"commit: {result['commit']}  verified: {result['verified']}")
        sys.stdout.flush()
        if args.serve:
            _serve(hub, work, snippets)
        else:
            print(f"[demo] the local Hub stops with the demo, so the repo URL above no longer answers; `make demo-serve` "
                  f"keeps it serving and prints the lines that run the card's snippets ({work / 'snippets'})",
                  file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
