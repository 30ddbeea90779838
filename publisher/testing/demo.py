"""Offline demo: a loopback Hub, a tiny FLUX pipeline seeded on it, published with --quant int8wo, loaded back.

    python -m publisher.testing.demo [--workdir demo-output] [--recipe int8wo]

Nothing leaves this machine: the Hub is publisher.testing.hubserver on 127.0.0.1, and the real
huggingface_hub client, the real CLI (as a subprocess) and diffusers talk to it via HF_ENDPOINT.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

DEMO_TOKENS = {"demo-token-bfl": "black-forest-labs", "demo-token-you": "demo-user"}


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
    args = parser.parse_args(argv)

    work = args.workdir.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    port = _free_port()
    # Must be set before huggingface_hub is imported (it reads them at import time).
    os.environ.update({
        "HF_ENDPOINT": f"http://127.0.0.1:{port}",
        "HF_HUB_DISABLE_XET": "1",
        "HF_HOME": str(work / "hf_home"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
    })
    os.environ.pop("HF_TOKEN", None)

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
        env = {**os.environ, "HF_TOKEN": "demo-token-you"}
        proc = subprocess.run([exe, *cmd[1:]], env=env, stdout=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            print(f"[demo] hf-ao-publish failed with exit code {proc.returncode}", file=sys.stderr)
            return proc.returncode
        result = json.loads(proc.stdout)

        import torch
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(result["repo_id"], torch_dtype=torch.bfloat16)
        weight = pipe.transformer.transformer_blocks[0].attn.to_q.weight
        image = pipe("a photo of a cat", num_inference_steps=2, height=64, width=64,
                     generator=torch.Generator().manual_seed(0)).images[0]
        image.save(work / "sample.png")
        print(f"[demo] loaded {result['repo_id']} back from the Hub: transformer weights are {type(weight).__name__}; "
              f"2-step sample saved to {work / 'sample.png'}", file=sys.stderr)
        print(f"card: {out_dir / 'README.md'}")
        print(f"repo: {result['url']}")
        print(f"commit: {result['commit']}  verified: {result['verified']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
