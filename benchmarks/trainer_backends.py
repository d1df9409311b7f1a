"""Trainer tokens/s by backend on the tiny model: torch (one process) vs deepspeed ZeRO-3 at
1 and 2 ranks (CPU, gloo), as ratios to torch measured in one run.

    python benchmarks/trainer_backends.py [--sequences 16] [--min-len 200] [--max-len 400]
        [--micro-batch 4] [--warmup 2] [--repeats 5] [--threads 1] [--out FILE.json]

The model and the batch are those of benchmarks/trainer_bench.py (the tiny model of
configs/tiny-cpu.yaml with random weights; ``--sequences`` synthetic sequences, the last 40%
response, old log-probs near the model's own), DPPO with the float32 head. Each variant runs
in its own spawned processes, one after the other: ``torch`` (``Trainer``), ``deepspeed-1``
and ``deepspeed-2`` (``DeepSpeedTrainer``, ZeRO-3, every parameter partitioned; with 2 ranks
each takes every other sequence). Every process uses ``--threads`` torch threads, so
deepspeed-2 uses twice the cores of the others. The figure: all tokens of the batch / the
median step time (rank 0's, after ``--warmup`` untimed steps), and the ratio to torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common import emit, machine  # benchmarks/common.py (scripts run from benchmarks/)

log = logging.getLogger("trainer_backends")
REPO = Path(__file__).resolve().parents[1]
VARIANTS = {"torch": ("torch", 1), "deepspeed-1": ("deepspeed", 1),
            "deepspeed-2": ("deepspeed", 2)}


def _rank(rank: int, world: int, port: int, backend: str, args: dict[str, Any],
          out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
    torch.set_num_threads(args["threads"])
    from trainer_bench import synthetic_samples, tiny_model

    from tmax.train.backends.config import TrainerSection
    from tmax.train.config import AlgoSection, OptimSection

    model, tokenizer = tiny_model(args["seed"])
    samples = synthetic_samples(model, len(tokenizer), args["sequences"], args["min_len"],
                                args["max_len"], args["seed"])
    kwargs: dict[str, Any] = {
        "algo": AlgoSection(), "optim": OptimSection(lr=3e-4,
                                                     micro_batch_size=args["micro_batch"]),
        "total_steps": 1000, "temperature": 1.0, "fp32_head": True, "pad_id": 0,
        "max_len": 1024}
    if backend == "torch":
        from tmax.train.trainer import Trainer

        trainer: Any = Trainer(model, **kwargs)
    else:
        from tmax.train.backends.deepspeed import DeepSpeedTrainer

        trainer = DeepSpeedTrainer(model, trainer=TrainerSection(
            backend="deepspeed", param_persistence_threshold=0), **kwargs)
    mine = samples[rank::world]
    times = []
    for i in range(args["warmup"] + args["repeats"]):
        t0 = time.perf_counter()
        trainer.step(mine)
        if i >= args["warmup"]:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps({
            "times": times, "tokens": sum(len(s.tokens) for s in samples),
            "response_tokens": sum(sum(s.mask[1:]) for s in samples),
            "params": sum(p.numel() for p in model.parameters()) if backend == "torch"
            else None}))


def run_variant(backend: str, world: int, args: argparse.Namespace, out: Path
                ) -> dict[str, Any]:
    import torch.multiprocessing as mp

    sys.path.insert(0, str(REPO))
    from tmax.train.backends.deepspeed import free_port

    mp.start_processes(_rank, args=(world, free_port(), backend, vars(args), str(out)),
                       nprocs=world, join=True, start_method="spawn")
    return json.loads(out.read_text())


def bench(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    results = {}
    for name, (backend, world) in VARIANTS.items():
        log.info("running %s", name)
        results[name] = run_variant(backend, world, args, workdir / f"{name}.json")
    base = statistics.median(results["torch"]["times"])
    rows = []
    for name, (backend, world) in VARIANTS.items():
        t = results[name]["times"]
        med = statistics.median(t)
        rows.append({"variant": name, "backend": backend, "ranks": world,
                     "median_step_s": round(med, 4), "min_step_s": round(min(t), 4),
                     "max_step_s": round(max(t), 4),
                     "tokens_per_s": round(results[name]["tokens"] / med, 1),
                     "vs_torch": round(base / med, 3)})
    first = results["torch"]
    return {"benchmark": "trainer tokens/s by backend", "machine": machine(),
            "torch": torch.__version__, "threads_per_process": args.threads,
            "model": f"tiny (configs/tiny-cpu.yaml shape), {first['params']} params",
            "batch": {"sequences": args.sequences, "tokens": first["tokens"],
                      "response_tokens": first["response_tokens"],
                      "micro_batch": args.micro_batch},
            "warmup": args.warmup, "repeats": args.repeats, "rows": rows}


def table(report: dict[str, Any]) -> str:
    lines = [(f"{'variant':12} {'ranks':>5} {'tokens/s':>9} {'x torch':>8} {'median s':>9} "
             f"{'min s':>7} {'max s':>7}")]
    for r in report["rows"]:
        lines.append(f"{r['variant']:12} {r['ranks']:>5} {r['tokens_per_s']:>9.0f} "
                     f"{r['vs_torch']:>8.2f} {r['median_step_s']:>9.3f} "
                     f"{r['min_step_s']:>7.3f} {r['max_step_s']:>7.3f}")
    return "\n".join(lines)


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=200)
    parser.add_argument("--max-len", type=int, default=400)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the report as JSON here")
    args = parser.parse_args()
    if not 2 <= args.min_len <= args.max_len <= 1024:
        parser.error("need 2 <= --min-len <= --max-len <= 1024 (the model's context)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="trainer-backends-") as tmp:
        report = bench(args, Path(tmp))
    b = report["batch"]
    emit(report, f"{report['benchmark']}: {report['model']}; {b['sequences']} sequences, "
         f"{b['tokens']} tokens ({b['response_tokens']} response), micro-batch "
         f"{b['micro_batch']}; median of {report['repeats']} steps after {report['warmup']} "
         f"warm-up; {report['threads_per_process']} torch thread(s) per process; torch "
         f"{report['torch']}; {report['machine']}", table(report), args.out)


if __name__ == "__main__":
    main()
