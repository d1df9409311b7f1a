#!/usr/bin/env bash
# The GPU check: one GPU, no network, no vLLM. DeepSpeed ZeRO-3 in bf16 over NCCL (the model
# built under zero.Init), the chunked FP32 LM head, the hf-server (`tmax serve`) on CUDA,
# three DPPO steps with a weight sync after each; prints the trainer-vs-engine log-prob
# gap and tokens/s (generation, trainer), and OK or FAILED. Under 8 minutes (timeout 480).
#   benchmarks/gpu_check.sh [--steps 3] [--out report.json]
#
# What it needs beyond a CUDA build of torch (the GPU machine's own): deepspeed==0.19.8
# (pure Python, built with DS_BUILD_OPS=0: no compiled ops are used), transformers,
# tokenizers, safetensors, huggingface-hub, and TMax's own dependencies (numpy, pydantic,
# pyyaml, click, httpx, aiohttp, tqdm, ...). How they travel: as wheels, in a wheelhouse
# folder inside the working tree that goes with it (size not measured yet):
#   here:        bin/tmax-gpu-wheels .wheels --python-version 3.11   (pip download/wheel)
#   GPU machine: TMAX_WHEELS=.wheels benchmarks/gpu_check.sh
# which makes a venv over the machine's torch (--system-site-packages) and installs the
# wheels and TMax into it offline (pip --no-index). Without TMAX_WHEELS it runs
# ${TMAX_PYTHON:-.venv/bin/python}, which must import all of them already.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${TMAX_PYTHON:-$root/.venv/bin/python}
if [[ -n "${TMAX_WHEELS:-}" ]]; then
  venv=${TMAX_GPU_VENV:-${TMPDIR:-/tmp}/tmax-gpu-venv}
  base=${TMAX_BASE_PYTHON:-python3}
  [[ -x $venv/bin/python ]] || "$base" -m venv --system-site-packages "$venv"
  DS_BUILD_OPS=0 "$venv/bin/python" -m pip install -q --no-index --find-links "$TMAX_WHEELS" \
    --no-build-isolation -e "$root" deepspeed==0.19.8
  python=$venv/bin/python
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
"$python" -c 'import torch, deepspeed, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "deepspeed", deepspeed.__version__, "transformers", transformers.__version__)'
exec timeout 480 "$python" "$root/benchmarks/gpu_check.py" "$@"
