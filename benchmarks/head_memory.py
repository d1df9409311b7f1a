"""Peak trainer memory against sequence length at Qwen3.5's vocabulary (248,320), before and
after the chunked FP32 LM head.

    python benchmarks/head_memory.py [--plain 256,512,1024] [--chunked 256,...,8192]
        [--chunk 1024] [--out FILE.json]

One trainer step's forward and backward (``Trainer.forward_backward``: DPPO, float32 head,
temperature 1) on one sequence of T tokens, the last half response, through a narrow
Llama (1 layer, d_model 64, untied head of 248,320 x 64), on CPU. The model is narrow on
purpose: what grows with T is the head's [T, V] float32 work, which is the same at any
width; a 9B model adds its layers' activations (see trainer.activation_checkpointing).

- ``plain``: the path the trainer had (``logits_of`` + ``logprobs_of_logits``: the full
  [T, V] float32 logits, a temperature-scaled copy, log_softmax, the entropy pass, and
  their gradients);
- ``chunked``: ``tmax.train.head`` (``--chunk`` positions of logits at once, recomputed in
  the backward), as the trainer runs now.

Each (mode, T) runs in a fresh process; the figure is that process's peak resident memory
(``ru_maxrss``) less its resident memory just before the step (model, optimizer and torch
already loaded), in MiB.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

from common import emit, machine  # benchmarks/common.py (scripts run from benchmarks/)

REPO = Path(__file__).resolve().parents[1]
VOCAB = 248_320


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one(mode: str, length: int, chunk: int) -> dict[str, Any]:
    """In this (fresh) process: one forward+backward, its memory."""
    sys.path.insert(0, str(REPO))
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tmax.train.config import AlgoSection, OptimSection
    from tmax.train.trainer import (
        Sample,
        Trainer,
        logits_of,
        logprobs_of_logits,
        policy_loss,
    )

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=length + 1,
        tie_word_embeddings=False))

    class Plain(Trainer):
        def loss(self, batch, n_tokens):
            logits = logits_of(self.model, batch["input_ids"], batch["attention_mask"],
                               fp32_head=True)
            logp, entropy = logprobs_of_logits(logits, batch["input_ids"], temperature=1.0)
            return policy_loss(logp, entropy, batch, algo=self.algo, n_tokens=n_tokens)

    cls = Plain if mode == "plain" else Trainer
    trainer = cls(model, algo=AlgoSection(), optim=OptimSection(micro_batch_size=1),
                  total_steps=1, temperature=1.0, fp32_head=True, pad_id=0,
                  max_len=length, head_chunk=chunk)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (length,), generator=g).tolist()
    half = length // 2
    sample = Sample(tokens, [0.0] * half + [-1.0] * (length - half),
                    [0] * half + [1] * (length - half), 1.0)
    before = rss_mib()
    trainer.forward_backward([sample])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"mode": mode, "tokens": length, "peak_mib": round(peak - before, 1),
            "fp32_TxV_mib": round(length * VOCAB * 4 / 2**20, 1)}


def measure(mode: str, length: int, chunk: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--one", mode, str(length), str(chunk)],
                         capture_output=True, text=True, timeout=1800, check=False)
    if out.returncode != 0:
        return {"mode": mode, "tokens": length, "error": out.stderr.strip()[-500:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--one":
        print(json.dumps(one(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plain", default="256,512,1024", help="lengths for the plain path")
    p.add_argument("--chunked", default="256,512,1024,2048,4096,8192",
                   help="lengths for the chunked head")
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    rows = [measure("plain", int(t), args.chunk) for t in args.plain.split(",") if t]
    rows += [measure("chunked", int(t), args.chunk) for t in args.chunked.split(",") if t]
    report = {"benchmark": "trainer peak memory vs sequence length", "machine": machine(),
              "vocab": VOCAB, "chunk": args.chunk, "rows": rows}
    lines = ["mode     tokens  peak MiB  (one fp32 [T,V]: MiB)"]
    for r in rows:
        lines.append(f"{r['mode']:8} {r['tokens']:6}  " + (
            f"{r['peak_mib']:8.0f}  ({r['fp32_TxV_mib']:.0f})" if "peak_mib" in r
            else f"error: {r['error'][-200:]}"))
    emit(report, f"{report['benchmark']} at V={VOCAB}, chunk {args.chunk}; "
         f"{report['machine']}", "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
