#!/usr/bin/env bash
# Device check (see scripts/gpu_check.py): the real CLI on the GPU per GPU recipe and engine. One run on the lent GPU:
#
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=600)
#
# .whl/ (git-ignored, ~9.3 MiB) holds the two packages the device image lacks, downloaded for
# its Python 3.12 with the device README's `pip download` line:
#   torchao-0.18.0-cp310-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl, diffusers-0.42.1-py3-none-any.whl
# The image's own torch 2.11.0+cu130, accelerate 1.15.0, safetensors 0.8.0 and huggingface_hub
# 1.33.0 are used (diffusers 0.42.1 needs hub >= 1.32; torchao 0.18 needs torch >= 2.11).
# Results land in $OUT (results.json, table.md, cli.log, gpu_check.log, nvidia-smi.txt): they are rewritten
# after every CLI run, so even a run stopped at timeout_s returns what it measured. No run starts after
# --time-budget (540 s by default) would be exceeded; every GPU recipe's reference (library) run comes first.
#
# Locally (no GPU):  PYTHON=.venv/bin/python bash scripts/gpu_check.sh --dry-run --assume-cc 9.0
# Arguments: gpu_check.py options; --out defaults to $OUT, else ./gpu-check-out.
set -uo pipefail
cd "$(dirname "$0")/.."

out="${OUT:-./gpu-check-out}"
mkdir -p "$out"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1  # no network there: never wait on the Hub

# Install the carried wheels only when the interpreter lacks the pinned versions (the device has
# no package index); --target keeps the image's site-packages untouched; then compile their bytecode.
"$PY" -m compileall -q -j 0 publisher >/dev/null 2>&1 || true  # the checkout's own, once
if ! "$PY" - <<'PYEOF' 2>/dev/null
import importlib.metadata as m, sys
sys.exit(0 if (m.version("torchao"), m.version("diffusers")) == ("0.18.0", "0.42.1") else 1)
PYEOF
then
    if ls .whl/*.whl >/dev/null 2>&1; then
        echo "installing $(ls .whl/*.whl | xargs -n1 basename | tr '\n' ' ') into /tmp/site"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            || echo "WARNING: wheel install failed; continuing with what is installed"
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
        # their bytecode now, on every core, not in the first CLI run (it took about 120 s on a fresh device, against
        # about 100 s for each later run) nor again in each fresh interpreter a run starts
        "$PY" -m compileall -q -j 0 /tmp/site >/dev/null 2>&1 || true
    else
        echo "WARNING: torchao 0.18.0 / diffusers 0.42.1 missing and no .whl/ carried"
    fi
fi

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 || true; } >"$out/nvidia-smi.txt"
"$PY" scripts/gpu_check.py --out "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
