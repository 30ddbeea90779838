#!/usr/bin/env bash
# One prepared run on a lent NVIDIA GPU (issue 8): the GPU check table, then the real CLI on the GPU
# (float8dq, int4wo, int8wo on the tiny FLUX pipeline), then the CPU-made float8dq checkpoint
# compared with the GPU-made one tensor by tensor and run on the GPU.
#   run(command="bash scripts/device_run.sh", carry=[".whl"], timeout_s=420)
# Writes 8 files under $OUT (the device tool's limit): gpu/{results.json,table.md,gpu_check.log,nvidia-smi.txt},
# cli_gpu.json, cli_cpu.json, cli.log, compare.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./device-out}"
mkdir -p "$OUT/gpu"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
SKIP_GPU_CHECK="${SKIP_GPU_CHECK:-0}"
if [ "$SKIP_GPU_CHECK" != 1 ]; then
    timeout 200 bash scripts/gpu_check.sh "$OUT/gpu" --time-budget 130 --min-compile-s 25 >/dev/null 2>&1
    echo "gpu_check exit $?"
fi
log="$OUT/cli.log"
python3 -m publisher.testing.tiny flux /tmp/dev-tiny-flux >>"$log" 2>&1
echo "== GPU: float8dq, int4wo, int8wo" >>"$log"
timeout 130 python3 -m publisher.cli /tmp/dev-tiny-flux --quant float8dq,int4wo,int8wo --keep-going --no-push \
    --output-dir /tmp/dev-cli-gpu --json --sample-steps 2 --sample-size 64 --sample-prompt "a red cube" \
    >"$OUT/cli_gpu.json" 2>>"$log"
echo "cli gpu exit $?" | tee -a "$log"
echo "== CPU (CUDA hidden): float8dq" >>"$log"
CUDA_VISIBLE_DEVICES= timeout 90 python3 -m publisher.cli /tmp/dev-tiny-flux --quant float8dq --no-push \
    --output-dir /tmp/dev-cli-cpu --json --sample-steps 2 --sample-size 64 >"$OUT/cli_cpu.json" 2>>"$log"
echo "cli cpu exit $?" | tee -a "$log"
{
    echo "== float8dq transformer: GPU-made vs CPU-made"
    python3 scripts/compare_checkpoints.py /tmp/dev-cli-gpu/float8dq/transformer /tmp/dev-cli-cpu/transformer
    echo "exit $?"
    echo "== the CPU-made checkpoint verified on the GPU (library and manual paths, forward on cuda)"
    python3 -m publisher.cli verify /tmp/dev-cli-cpu --json 2>&1 | tail -40
} >"$OUT/compare.txt" 2>&1
tail -3 "$OUT/compare.txt"
