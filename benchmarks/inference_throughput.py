"""Generation throughput (completion tokens/s): hf-server (``tmax serve`` in its own process,
driven over HTTP by ``HttpEngine``) vs the same HFPolicy in this process
(``InProcessEngine``), on the tiny model, as a ratio measured in one run.

    python benchmarks/inference_throughput.py [--concurrency 1,16] [--max-tokens 64]
        [--repeats 5] [--threads 1] [--out FILE.json]

The model is the tiny one of configs/tiny-cpu.yaml (2 layers, d_model 128, 4 heads, BPE
vocabulary 2048 trained on the example tasks' texts), random weights, saved to a temporary
folder that both engines load. One round sends ``c`` chat requests at once (the same
system prompt, a distinct user line each) and waits for all of them; its figure is the
completion tokens of all answers / the round's wall seconds. Both engines sample at
temperature 1 and batch what waits together (at most ``c`` per batch). After one untimed
warm-up round each, ``--repeats`` rounds alternate between the engines (so load on a
shared machine hits both alike); the table shows the median tokens/s and hf-server's ratio
to in-process at each concurrency. torch runs ``--threads`` intra-op threads in both (the
server gets ``OMP_NUM_THREADS``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import emit, machine  # benchmarks/common.py (scripts run from benchmarks/)

from tmax.inference.http import HttpEngine
from tmax.inference.inprocess import InProcessEngine
from tmax.inference.process import ServerProcess, free_port, hf_server_command

REPO = Path(__file__).resolve().parents[1]

SYSTEM = "You are an agent in a Linux terminal. Answer with one bash command."


def chats(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "system", "content": SYSTEM},
             {"role": "user", "content": f"Task {i}: list the files in /app."}]
            for i in range(n)]


async def one_round(engine: Any, n: int) -> tuple[int, float]:
    started = time.perf_counter()
    results = await asyncio.gather(*(engine.complete(c) for c in chats(n)))
    return sum(len(r.completion_ids) for r in results), time.perf_counter() - started


def build_model(folder: Path) -> Path:
    from tmax.models.tiny import (
        build_tiny_model,
        build_tokenizer,
        corpus_texts,
        save_pretrained_dir,
    )
    from tmax.tasks import find_tasks

    tokenizer = build_tokenizer(corpus_texts(find_tasks(REPO / "examples" / "tasks")))
    model = build_tiny_model(tokenizer, n_layers=2, d_model=128, n_heads=4, seed=0)
    return save_pretrained_dir(model, tokenizer, folder / "tiny")


async def measure(model_dir: Path, levels: list[int], max_tokens: int, repeats: int,
                  threads: int, log_dir: Path) -> dict[str, Any]:
    batch = max(levels)
    local = InProcessEngine.from_pretrained(model_dir, max_new_tokens=max_tokens,
                                            max_batch=batch, seed=0)
    port = free_port()
    server = ServerProcess(
        hf_server_command(model_dir, port=port, max_batch=batch, max_tokens=max_tokens,
                          served_model_name="tiny", seed=0),
        url=f"http://127.0.0.1:{port}", log_path=log_dir / "server.log",
        env={"OMP_NUM_THREADS": str(threads)}, name="hf-server", start_timeout_s=180)
    remote = HttpEngine(f"http://127.0.0.1:{port}/v1", "tiny", concurrency=batch)
    rows = []
    async with server:
        try:
            for n in levels:
                figures: dict[str, list[float]] = {"in-process": [], "hf-server": []}
                tokens: dict[str, int] = {"in-process": 0, "hf-server": 0}
                engines = {"in-process": local, "hf-server": remote}
                for engine in engines.values():
                    await one_round(engine, n)  # warm-up
                for _ in range(repeats):
                    for name, engine in engines.items():
                        count, seconds = await one_round(engine, n)
                        figures[name].append(count / seconds)
                        tokens[name] += count
                median = {k: statistics.median(v) for k, v in figures.items()}
                rows.append({"concurrency": n, "tokens_per_s": median, "tokens": tokens,
                             "all_tokens_per_s": figures,
                             "ratio": median["hf-server"] / median["in-process"]})
        finally:
            await remote.aclose()
    return {"rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    levels = [int(x) for x in args.concurrency.split(",")]
    where = machine()
    with tempfile.TemporaryDirectory(prefix="tmax-inference-bench-") as tmp:
        model_dir = build_model(Path(tmp))
        report = asyncio.run(measure(model_dir, levels, args.max_tokens, args.repeats,
                                     args.threads, Path(tmp)))
    report.update(machine=where, max_tokens=args.max_tokens, repeats=args.repeats,
                  threads=args.threads)
    header = (f"{'concurrency':>11}  {'in-process tok/s':>16}  {'hf-server tok/s':>15}  "
              f"{'ratio':>6}")
    lines = [header]
    for r in report["rows"]:
        t = r["tokens_per_s"]
        lines.append(f"{r['concurrency']:>11}  {t['in-process']:>16.1f}  "
                     f"{t['hf-server']:>15.1f}  {r['ratio']:>6.2f}")
    emit(report, f"inference throughput, tiny model, max_tokens {args.max_tokens}, "
         f"{args.repeats} rounds, {args.threads} torch thread(s); {where}",
         "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
