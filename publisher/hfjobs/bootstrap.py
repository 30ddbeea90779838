"""Runs inside a Hugging Face Job: install the very hf-ao-publish that submitted the job, run it, report.

The job's command is ``python -c <this file's text> SPEC``, so this file is stdlib-only and imports nothing
of ours (the job's image has only Python and pip). SPEC is JSON:

    {"endpoint": "https://huggingface.co",
     "wheel": {"path": "datasets/alice/hf-ao-publish-jobs/resolve/<sha>/hf_ao_publish-...whl", "sha256": "..."},
     "torch": {"requirement": "torch==2.13.0", "index_url": "https://download.pytorch.org/whl/cpu" | ""},
     "constraints": ["torchao==0.18.0", "diffusers==0.42.1", ...],
     "args": ["publish", "org/model", "--quant", "int4wo", ..., "--json"]}

Steps: download the wheel with the HF_TOKEN secret (the token is never an argument or a plain environment
variable of the job) and check its sha256; pip-install torch from the index that fits the flavor, then the
wheel with the exact set the project's tests ran with as constraints (its constraints.txt, less torch; the wheel
itself states ranges); run ``hf-ao-publish ARGS`` with its stderr in the job
log; then write the CLI's stdout (its --json result) to the log as base64 chunks between markers, and the exit
code. The local side (publisher/hfjobs/follow.py) reads those lines back, so the result a user sees is the
one this job computed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request

RESULT_MARKER = "##[hf-ao-publish:result]"  # + " i/n base64-chunk"
EXIT_MARKER = "##[hf-ao-publish:exit]"  # + " code"
CHUNK = 3000  # characters of base64 per log line: far below any log line limit
PREFIX = "hf-ao-publish job:"


def say(message: str) -> None:
    print(f"{PREFIX} {message}", flush=True)


def download(url: str, token: str | None, dest: str, tries: int = 4) -> None:
    """GET url into dest. The token goes only to the Hub itself: an unredirected header is not sent on
    to the storage host a resolve URL redirects to (its URL is signed)."""
    for attempt in range(1, tries + 1):
        request = urllib.request.Request(url, headers={"User-Agent": "hf-ao-publish-job"})
        if token:
            request.add_unredirected_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=60) as response, open(dest, "wb") as out:
                shutil.copyfileobj(response, out, 1 << 20)
            return
        except urllib.error.HTTPError as exc:
            if exc.code < 500 and exc.code != 429 or attempt == tries:
                raise SystemExit(f"{PREFIX} cannot download the tool's wheel: HTTP {exc.code} for {url}") from None
        except (urllib.error.URLError, OSError) as exc:
            if attempt == tries:
                raise SystemExit(f"{PREFIX} cannot download the tool's wheel from {url}: {exc}") from None
        time.sleep(2 ** attempt)


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pip_install(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
           *args]
    say("+ " + " ".join(cmd[1:]))
    code = subprocess.call(cmd)
    if code != 0:
        raise SystemExit(f"{PREFIX} installation failed (pip exit code {code}): {' '.join(args)}")


def console_script() -> list[str]:
    script = os.path.join(sysconfig.get_path("scripts"), "hf-ao-publish")
    if os.path.exists(script):
        return [script]
    found = shutil.which("hf-ao-publish")
    if found:
        return [found]
    raise SystemExit(f"{PREFIX} the wheel installed no hf-ao-publish console script")


def report(stdout: str, code: int) -> None:
    """The CLI's JSON result (if it printed one) and its exit code, as marker lines of the log."""
    text = stdout.strip()
    if text:
        encoded = base64.b64encode(text.encode("utf-8")).decode("ascii")
        chunks = [encoded[i:i + CHUNK] for i in range(0, len(encoded), CHUNK)]
        for i, chunk in enumerate(chunks, 1):
            print(f"{RESULT_MARKER} {i}/{len(chunks)} {chunk}", flush=True)
    print(f"{EXIT_MARKER} {code}", flush=True)


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    token = os.environ.get("HF_TOKEN") or None
    work = tempfile.mkdtemp(prefix="hf-ao-publish-job-")
    wheel = spec["wheel"]
    filename = wheel["path"].rsplit("/", 1)[-1]
    local = os.path.join(work, filename)
    say(f"downloading {filename}")
    download(f"{spec['endpoint'].rstrip('/')}/{wheel['path']}", token, local)
    found = sha256_of(local)
    if found != wheel["sha256"]:
        raise SystemExit(f"{PREFIX} {filename} has sha256 {found}, expected {wheel['sha256']}; not installing it")
    torch = spec["torch"]
    pip_install(torch["requirement"], *(["--index-url", torch["index_url"]] if torch.get("index_url") else []))
    constraints = os.path.join(work, "constraints.txt")
    with open(constraints, "w", encoding="utf-8") as f:
        f.write("".join(f"{line}\n" for line in spec.get("constraints") or []))
    pip_install(local, "-c", constraints)
    cmd = console_script() + list(spec["args"])
    say("+ hf-ao-publish " + " ".join(spec["args"]))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, encoding="utf-8", errors="replace")
    stdout, _ = proc.communicate()
    report(stdout, proc.returncode)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
