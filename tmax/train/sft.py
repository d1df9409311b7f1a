"""Supervised warm-start on reference solutions, in the harness's text protocol.

Each task becomes the conversation an oracle-like episode would have: the harness's system
and first user message, the assistant running the task's ``solve.sh`` body as one fenced
command, the harness's observation of it (``[no output]``, exit code 0), and the assistant
submitting. Conversations are tokenised with the policy's own ``render_messages`` (the same
ids HFPolicy would see), and the loss is the mean token cross-entropy over assistant
tokens (content and closing ``<|im_end|>``) only.

Deviation from running solve.sh verbatim: the shebang, comment-only lines (outside
here-documents) and top-level ``set -e``-style lines are dropped, since the command runs in
the agent's persistent shell, where ``set -e`` would end the shell at the first failure.
"""

from __future__ import annotations

import logging
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from tqdm.auto import tqdm

from tmax.agent.config import AgentConfig
from tmax.agent.harness import Agent, observation
from tmax.agent.policies.hf import render_messages
from tmax.tasks.model import Task
from tmax.tasks.native import load_task

log = logging.getLogger(__name__)

HEREDOC_RE = re.compile(r"(?<!<)<<-?(?!<)\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")
SET_OPTIONS_RE = re.compile(r"^set(\s+([-+][A-Za-z]+|[a-z]+))+$")


@dataclass
class _Result:
    output: str = ""
    exit_code: int = 0
    timed_out: bool = False
    oom: bool = False


class _TextPolicy:
    name = "sft"
    supports_tools = False


def solution_command(script: str) -> str:
    """The command an agent would type for a solve.sh: shebang, comment-only lines and
    ``set -e`` lines dropped (not inside here-documents), outer blank lines stripped."""
    lines: list[str] = []
    terminators: list[str] = []
    for line in script.splitlines():
        if terminators:
            lines.append(line)
            if line.strip() == terminators[0]:
                terminators.pop(0)
            continue
        stripped = line.strip()
        if stripped.startswith("#") or _sets_errexit(stripped):
            continue
        lines.append(line)
        terminators += [m.group(2) for m in HEREDOC_RE.finditer(line)]
    return "\n".join(lines).strip("\n")


def _sets_errexit(line: str) -> bool:
    """``set -e``, ``set -euo pipefail``, ``set -o errexit``...: only shell options."""
    if not SET_OPTIONS_RE.match(line):
        return False
    words = line.split()[1:]
    return "errexit" in words or any(w.startswith("-") and not w.startswith("--")
                                     and "e" in w for w in words)


def sft_conversation(task: Task | str | Path, agent_config: AgentConfig) -> list[dict[str, Any]]:
    """The messages of an oracle-like text-protocol episode for ``task``."""
    if agent_config.protocol == "tools":
        raise ValueError("SFT conversations use the text protocol; the agent config forces "
                         "protocol: tools")
    if not isinstance(task, Task):
        task = load_task(task)
    command = solution_command((task.solution_dir / "solve.sh").read_text())
    if not command:
        raise ValueError(f"{task.task_id}: solution/solve.sh holds no command")
    # only the prompt is rendered: no policy call, no shell
    messages = Agent(cast(Any, _TextPolicy()), cast(Any, None),
                     agent_config).initial_messages(task.instruction)
    seen = observation(_Result(), agent_config, agent_config.command_timeout_s)
    return [*messages,
            {"role": "assistant", "content": f"```bash\n{command}\n```"},
            {"role": "user", "content": seen},
            {"role": "assistant", "content": f"```bash\n{agent_config.submit_command}\n```"}]


def encode_conversation(tokenizer: Any, messages: list[dict[str, Any]]
                        ) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)``: the policy's rendering; mask 1 on assistant content
    tokens and their ``<|im_end|>`` only."""
    return render_messages(tokenizer, messages)


def sft(model: Any, tokenizer: Any, conversations: list[list[dict[str, Any]]], *, steps: int,
        lr: float = 3e-3, batch_size: int = 8, seed: int = 0, log_every: int = 50,
        progress: bool = True) -> list[float]:
    """Train ``model`` in place (AdamW, constant lr, grad-norm clip 1.0) on
    ``conversations``; the loss per step (mean over masked tokens) is returned.

    Batches are drawn from reshuffled passes over the conversations (seeded), right-padded;
    padding carries neither attention nor loss."""
    encoded = [encode_conversation(tokenizer, c) for c in conversations]
    if not encoded:
        raise ValueError("no conversations to train on")
    from tmax.train.model_load import context_length

    limit = context_length(model.config)
    too_long = [len(ids) for ids, _ in encoded if len(ids) > limit]
    if too_long:
        raise ValueError(f"{len(too_long)} conversations exceed the model's {limit} "
                         f"positions (longest {max(too_long)} tokens)")
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    order: list[int] = []
    losses: list[float] = []
    model.train()
    bar = tqdm(range(steps), desc="sft", disable=not progress)
    try:
        for step in bar:
            batch = []
            for _ in range(batch_size):
                if not order:
                    order = list(range(len(encoded)))
                    rng.shuffle(order)
                batch.append(encoded[order.pop()])
            loss = _step_loss(model, batch, pad, device)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            if log_every and (step + 1) % log_every == 0:
                log.info("sft step %d/%d loss %.4f", step + 1, steps, losses[-1])
    finally:
        model.eval()
    return losses


def _step_loss(model: Any, batch: list[tuple[list[int], list[int]]], pad: int,
               device: torch.device) -> torch.Tensor:
    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.float32)
    for i, (seq, m) in enumerate(batch):
        ids[i, :len(seq)] = torch.tensor(seq)
        attention[i, :len(seq)] = 1
        mask[i, :len(m)] = torch.tensor(m, dtype=torch.float32)
    ids, attention, mask = ids.to(device), attention.to(device), mask.to(device)
    logits = model(input_ids=ids, attention_mask=attention).logits.float()   # [B, T, V]
    logp = torch.log_softmax(logits[:, :-1], -1)                              # predicts 1..T-1
    target = logp.gather(-1, ids[:, 1:, None])[..., 0]                        # [B, T-1]
    weight = mask[:, 1:]
    return -(target * weight).sum() / weight.sum().clamp(min=1.0)
