#!/usr/bin/env bash
# The GPU check: one GPU, no network, no vLLM. DeepSpeed ZeRO-3 in bf16 over NCCL (the model
# built under zero.Init), the chunked FP32 LM head, the hf-server (`tmax serve`) on CUDA,
# three DPPO steps with a weight sync after each; prints the trainer-vs-engine log-prob
# gap and tokens/s (generation, trainer), and OK or FAILED. 70 s on one H200 with the wheel
# install (docs/trainer.md); stopped after TMAX_GPU_TIMEOUT seconds (480).
#   benchmarks/gpu_check.sh [--steps 3] [--out report.json]
#
# What it needs beyond a CUDA build of torch (the GPU machine's own): deepspeed==0.19.8
# (pure Python, built with DS_BUILD_OPS=0: no compiled ops are used), transformers,
# tokenizers, safetensors, huggingface-hub, and TMax's own dependencies (pydantic, pyyaml,
# click, httpx, aiohttp, tqdm, ...). On a machine with no network the ones it lacks travel
# as wheels, in a folder inside the working tree that goes with it:
#   GPU machine: python3 -m pip list --format=freeze > have.txt      (once; bring it here;
#                the H200 this project is lent: benchmarks/gpu_check.h200-packages.txt)
#   here:        bin/tmax-gpu-wheels .whl --python-version 3.12 --have have.txt
#   GPU machine: TMAX_WHEELS=.whl benchmarks/gpu_check.sh --out report.json
# which installs the wheels offline (--no-deps) into ${TMAX_GPU_SITE:-/tmp/tmax-gpu-site}
# and runs the machine's python3 (TMAX_BASE_PYTHON) with that folder and TMax on
# PYTHONPATH: no venv, since a GPU image's python3 is often a venv itself, and a venv made
# from one with --system-site-packages does not see its packages (torch; seen with this
# checkout's .venv as the base). Without TMAX_WHEELS it runs
# ${TMAX_PYTHON:-.venv/bin/python}, which must import all of them already.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${TMAX_PYTHON:-$root/.venv/bin/python}
if [[ -n "${TMAX_WHEELS:-}" ]]; then
  site=${TMAX_GPU_SITE:-${TMPDIR:-/tmp}/tmax-gpu-site}
  python=${TMAX_BASE_PYTHON:-python3}
  shopt -s nullglob
  wheels=("$TMAX_WHEELS"/*.whl)
  ((${#wheels[@]})) || { echo "gpu_check: no wheels in TMAX_WHEELS=$TMAX_WHEELS" >&2; exit 2; }
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "${wheels[@]}"
  export PYTHONPATH=$site:$root${PYTHONPATH:+:$PYTHONPATH}
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# everything the check and the server import, before the long part
(cd "$root" && "$python" -c 'import torch, deepspeed, transformers, tmax.cli, tmax.train.backends.deepspeed
print("python", __import__("sys").version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "deepspeed", deepspeed.__version__, "transformers", transformers.__version__)')
exec timeout "${TMAX_GPU_TIMEOUT:-480}" "$python" "$root/benchmarks/gpu_check.py" "$@"
