"""Trainer step throughput (tokens/s) on the tiny model: DPPO with and without the float32
LM head, and the plain grpo_clip loss, in float32 and in bfloat16.

    python benchmarks/trainer_bench.py [--sequences 32] [--min-len 300] [--max-len 600]
        [--warmup 2] [--repeats 7] [--threads 1] [--micro-batch 16] [--out FILE.json]

The model is the tiny one of configs/tiny-cpu.yaml (2 layers, d_model 128, 4 heads, BPE
vocabulary 2048 trained on the example tasks' texts, tied embeddings), with random weights.
The batch is synthetic but shaped like a real step: ``--sequences`` sequences of uniformly
drawn lengths in [min-len, max-len], random token ids, the last 40% of each sequence marked
as response (loss mask 1), old log-probs = the model's own float32 log-probs plus N(0, 0.05)
noise on response tokens (so pi/mu is near 1, as on-policy), advantages N(0, 1).

Variants (``tmax.train.trainer.Trainer.step``, one full optimizer step each: forward,
backward over micro-batches, clipping, AdamW):

- ``dppo+fp32head``: the run's default (``algo.loss=dppo``, ``model.fp32_lm_head=true``);
- ``dppo``: the head in the model's dtype;
- ``grpo_clip``: the clipped PPO/GRPO loss (no DPPO trust mask), float32 head;

each with the model in float32 and in bfloat16 (``model.to(bfloat16)``: where the float32
head matters). Every variant trains its own copy of the same initial weights. After
``--warmup`` untimed steps each, ``--repeats`` rounds time one step of every variant
(interleaved, so load on a shared machine hits all of them alike); the figure is the median
tokens/s (all tokens of the batch, prompt included / step seconds) and the ratio to
``dppo+fp32head`` of the same dtype.
"""

from __future__ import annotations

import argparse
import copy
import logging
import random
import statistics
from pathlib import Path
from typing import Any

import torch
from common import emit, machine  # benchmarks/common.py (scripts run from benchmarks/)

log = logging.getLogger("trainer_bench")

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {  # name -> (algo.loss, fp32 head)
    "dppo+fp32head": ("dppo", True),
    "dppo": ("dppo", False),
    "grpo_clip": ("grpo_clip", True),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}



def tiny_model(seed: int) -> tuple[torch.nn.Module, Any]:
    """The tiny model and tokenizer of configs/tiny-cpu.yaml, random weights."""
    from tmax.agent.config import load_agent_config
    from tmax.models.tiny import build_tiny_model, build_tokenizer, corpus_texts
    from tmax.tasks import find_tasks

    agent = load_agent_config(REPO / "configs" / "agent-tiny.yaml")
    texts = corpus_texts(find_tasks(REPO / "examples" / "tasks"))
    texts += [agent.system_template, agent.instance_template]
    tokenizer = build_tokenizer(texts, 2048)
    model = build_tiny_model(tokenizer, n_layers=2, d_model=128, n_heads=4,
                             max_positions=1024, seed=seed)
    return model, tokenizer


def synthetic_samples(model: torch.nn.Module, vocab: int, n: int, min_len: int, max_len: int,
                      seed: int) -> list[Any]:
    """``n`` Samples: random tokens, last 40% response, old_logp near the model's own."""
    from tmax.rl import token_logprobs
    from tmax.train.trainer import Sample

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        tokens = torch.randint(1, vocab, (length,), generator=gen)
        with torch.no_grad():
            logits = model(input_ids=tokens[None]).logits[:, :-1].float()   # [1,T-1,V]
            own = token_logprobs(logits, tokens[None, 1:])[0]               # [T-1]
        start = length - int(0.4 * length)
        mask = [0] * start + [1] * (length - start)
        noisy = (own + 0.05 * torch.randn(own.shape, generator=gen)).clamp(max=0.0)
        old = [0.0] + noisy.tolist()                   # old_logp[t] is token t's log-prob
        old = [lp if m else 0.0 for lp, m in zip(old, mask, strict=True)]
        samples.append(Sample(tokens.tolist(), old, mask, rng.gauss(0.0, 1.0)))
    return samples


def make_trainer(model: torch.nn.Module, loss: str, fp32_head: bool, micro_batch: int):
    from tmax.train.config import AlgoSection, OptimSection
    from tmax.train.trainer import Trainer

    return Trainer(model, algo=AlgoSection(loss=loss), optim=OptimSection(
        lr=3e-4, micro_batch_size=micro_batch), total_steps=1000, temperature=1.0,
        fp32_head=fp32_head, pad_id=0, max_len=1024)


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm.auto import tqdm

    torch.manual_seed(args.seed)
    model, tokenizer = tiny_model(args.seed)
    samples = synthetic_samples(model, len(tokenizer), args.sequences, args.min_len,
                                args.max_len, args.seed)
    tokens = sum(len(s.tokens) for s in samples)
    response = sum(sum(s.mask[1:]) for s in samples)
    trainers = {}
    for dtype in DTYPES:
        for name, (loss, head) in VARIANTS.items():
            copy_ = copy.deepcopy(model).to(DTYPES[dtype])
            trainers[(dtype, name)] = make_trainer(copy_, loss, head, args.micro_batch)
    times: dict[tuple[str, str], list[float]] = {k: [] for k in trainers}
    kept: dict[tuple[str, str], float] = {}
    keys = list(trainers)
    with tqdm(total=len(keys) * (args.warmup + args.repeats), desc="trainer steps") as bar:
        for key in keys:
            for _ in range(args.warmup):
                trainers[key].step(samples)
                bar.update(1)
        for r in range(args.repeats):
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:  # rotate the order
                metrics = trainers[key].step(samples)
                times[key].append(metrics["train_seconds"])
                kept[key] = metrics.get("kept_fraction", float("nan"))
                bar.update(1)
    rows = []
    for dtype in DTYPES:
        base = statistics.median(times[(dtype, "dppo+fp32head")])
        for name in VARIANTS:
            t = times[(dtype, name)]
            med = statistics.median(t)
            rows.append({"dtype": dtype, "variant": name, "median_step_s": round(med, 4),
                         "min_step_s": round(min(t), 4), "max_step_s": round(max(t), 4),
                         "tokens_per_s": round(tokens / med, 1),
                         "vs_dppo_fp32head": round(base / med, 3),
                         "kept_fraction_last": round(kept[(dtype, name)], 4)})
    return {"benchmark": "trainer step throughput", "machine": machine(),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "model": "tiny: 2 layers, d_model 128, 4 heads, vocab "
                     f"{len(tokenizer)}, {sum(p.numel() for p in model.parameters())} params",
            "batch": {"sequences": len(samples), "tokens": tokens,
                      "response_tokens": response, "micro_batch": args.micro_batch},
            "warmup": args.warmup, "repeats": args.repeats, "rows": rows}


def table(report: dict[str, Any]) -> str:
    lines = [(f"{'dtype':9} {'variant':14} {'tokens/s':>9} {'x dppo+fp32':>11} "
              f"{'median s':>9} {'min s':>7} {'max s':>7}")]
    for r in report["rows"]:
        lines.append(f"{r['dtype']:9} {r['variant']:14} {r['tokens_per_s']:>9.0f} "
                     f"{r['vs_dppo_fp32head']:>11.2f} {r['median_step_s']:>9.3f} "
                     f"{r['min_step_s']:>7.3f} {r['max_step_s']:>7.3f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=300)
    parser.add_argument("--max-len", type=int, default=600)
    parser.add_argument("--micro-batch", type=int, default=16,
                        help="optim.micro_batch_size (16, as configs/tiny-cpu.yaml)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per variant")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the report as JSON here")
    args = parser.parse_args()
    if not 2 <= args.min_len <= args.max_len <= 1024:
        parser.error("need 2 <= --min-len <= --max-len <= 1024 (the model's context)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    report = bench(args)
    b = report["batch"]
    emit(report, f"{report['benchmark']}: {report['model']}; {b['sequences']} sequences, "
          f"{b['tokens']} tokens ({b['response_tokens']} response), micro-batch "
          f"{b['micro_batch']}; median of {report['repeats']} steps after {report['warmup']} "
          f"warm-up; torch {report['torch']}, {report['threads']} thread(s); "
          f"{report['machine']}", table(report), args.out)


if __name__ == "__main__":
    main()
