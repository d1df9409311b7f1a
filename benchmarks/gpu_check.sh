#!/usr/bin/env bash
# The GPU check (one GPU, no internet): vLLM with the FP32 head + DeepSpeed ZeRO-3 (bf16),
# three DPPO steps, a filesystem weight sync after each, the log-prob gap before and after.
# Needs the gpu extra (vllm, deepspeed): TMAX_EXTRAS=dev,gpu bin/tmax-setup. Under 8 minutes.
#   benchmarks/gpu_check.sh [--steps 3] [--out report.json]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${TMAX_PYTHON:-$root/.venv/bin/python}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
"$python" -c 'import vllm, deepspeed; print("vllm", vllm.__version__, "deepspeed", deepspeed.__version__)'
exec timeout 480 "$python" "$root/benchmarks/gpu_check.py" "$@"
