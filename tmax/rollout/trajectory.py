"""Trajectory records: everything one rollout did, written even when it failed.

A record is one JSON object per line in a results file (``append_jsonl``: one ``write``
of the whole line on an O_APPEND file, fsynced; a reader skips a torn last line, so a crash
mid-write loses at most that record and corrupts nothing).

Outcome fields:

- ``reward``: the verifier's reward in [0,1], or 0.0 when the episode ended for a policy
  reason that is not verified (``policy_failure``), or None when there is no reward
  (``infra_failure`` or ``verifier_error``; a verifier that needed the network and wrote 0
  has its 0 dropped).
- ``policy_failure``: the policy's own reason the episode did not submit: ``step_limit``,
  ``time_budget``, ``format_errors``, ``context_limit``, ``policy_error``, ``oom``; or
  ``verifier_timeout``: test.sh ran past its timeout on what the agent left, reward 0 (an
  agent can hang the tests on purpose, so this is never masked); ``contradicted_reward``
  (below); or None.
- ``infra_failure``: ``{"cause", "error", "message"}`` when the fleet (or the policy's
  endpoint) failed; such rollouts are re-run in evaluation and masked in training.
- ``verifier_error``: the verifier ran but gave no usable reward: it wrote none or a
  malformed one, or could not do its job (``needs network at grade time: <the
  line that says so>``, ``verifier could not run: uvx: command not found``). A task
  problem, not the agent's failure: ``scored`` is False, so evaluation leaves the episode
  out of its scores (and counts it) and training gives it no advantage (masked like an
  infra failure); it is not re-run.
- ``internal_error``: ``{"error", "message", "traceback"}`` when TMax's own code raised
  (a bug), neither the policy's failure nor the infrastructure's. Not scored, not re-run
  as a node failure; evaluation (``max_internal_errors``) and training stop once a few
  have happened, naming the first. The traceback is kept in the record, in the run folder.
- ``contradicted_reward``: why the verifier's own test report (pytest's ``--ctrf`` /
  ``--junitxml``) contradicts the reward of 1 it wrote (``tmax.tasks.reports``): the
  reward is 0 and ``policy_failure`` is ``contradicted_reward``, a policy outcome (a forged
  exit status is the policy's doing).
- ``grading_note``: evidence the grade did not follow (``tmax.tasks.grading``: a 0 whose
  output also showed the network missing), so a reader can judge it.
"""

from __future__ import annotations

import json
import os
import re
import time
import traceback
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Turn:
    """The tokens of one assistant turn, when the policy reports them."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    policy_version: int | None = None


@dataclass
class Trajectory:
    task: str
    policy: str
    trial: int = 0
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    domain: str = ""
    difficulty: str = ""
    image: str = ""
    started_at: float = field(default_factory=time.time)
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    reward: float | None = None
    reward_metrics: dict[str, float] = field(default_factory=dict)
    end_reason: str = ""
    policy_failure: str | None = None
    infra_failure: dict[str, Any] | None = None
    verifier_error: str | None = None
    verifier_output: str = ""
    """The tail of test.sh's output."""
    grading_note: str | None = None
    contradicted_reward: str | None = None
    internal_error: dict[str, Any] | None = None
    steps: int = 0
    format_errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds: queue (waiting for a sandbox), start (sandbox start), agent, verifier, total."""
    node: str = ""
    attempt: int = 0
    """How many earlier attempts of this (task, trial) failed on infrastructure."""

    @property
    def valid(self) -> bool:
        """Not an infrastructure failure: the attempt ran on a working fleet (an internal
        or verifier error is valid, but not ``scored``)."""
        return self.infra_failure is None

    @property
    def scored(self) -> bool:
        """The reward measures the agent: no infrastructure failure, no internal error and
        no verifier error. Evaluation scores and training advantages use only these."""
        return (self.infra_failure is None and self.internal_error is None
                and self.verifier_error is None)

    @property
    def outcome(self) -> str:
        """The outcome class: ``infra_failure``, ``internal_error``, ``verifier_error``,
        ``policy_failure`` (a scored 0 the policy's own limits ended) or ``scored``."""
        for name in ("infra_failure", "internal_error", "verifier_error", "policy_failure"):
            if getattr(self, name) is not None:
                return name
        return "scored"

    @property
    def score(self) -> float:
        """Reward for averaging: infra failures and internal errors have none (callers drop
        them); a verifier error gives 0 here, but evaluation and training leave it out (see
        ``scored``)."""
        if self.infra_failure is not None or self.internal_error is not None:
            what = "an infra failure" if self.infra_failure is not None else "an internal error"
            raise ValueError(f"trajectory {self.id} ({self.task}) is {what}")
        return 0.0 if self.reward is None else self.reward

    @property
    def policy_version(self) -> int | None:
        """Oldest weights version among the turns (None when unknown)."""
        versions = [t.policy_version for t in self.turns if t.policy_version is not None]
        return min(versions) if versions else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        data = dict(data)
        data["turns"] = [Turn(**t) for t in data.get("turns", [])]
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in known})

    def sequences(self) -> list[tuple[list[int], list[float], list[int]]]:
        """Token sequences for training: ``(tokens, logprobs, loss_mask)`` per sequence.

        Turns are merged into one sequence while each turn's prompt extends the previous
        turn's prompt + completion (the usual multi-turn case); otherwise a new sequence
        starts. Only sampled (assistant) tokens have mask 1; prompt and tool-observation
        tokens have mask 0 and log-prob 0.
        """
        out: list[tuple[list[int], list[float], list[int]]] = []
        tokens: list[int] = []
        logps: list[float] = []
        mask: list[int] = []
        for turn in self.turns:
            if tokens and turn.prompt_ids[:len(tokens)] == tokens:
                extra = turn.prompt_ids[len(tokens):]
            else:
                if tokens:
                    out.append((tokens, logps, mask))
                tokens, logps, mask = [], [], []
                extra = turn.prompt_ids
            tokens = tokens + list(extra) + list(turn.completion_ids)
            logps = logps + [0.0] * len(extra) + list(turn.logprobs)
            mask = mask + [0] * len(extra) + [1] * len(turn.completion_ids)
        if tokens:
            out.append((tokens, logps, mask))
        return out


MAX_TRACEBACK = 20000


def internal_error(e: BaseException) -> dict[str, str]:
    """The ``internal_error`` record of ``e``: its type, message and traceback (the last
    ``MAX_TRACEBACK`` characters)."""
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    return {"error": type(e).__name__, "message": f"{type(e).__name__}: {e}",
            "traceback": text[-MAX_TRACEBACK:]}


def verifier_error_cause(text: str) -> str:
    """The cause of a ``verifier_error`` without its details: ``needs network at grade
    time``, ``verifier could not run``, ``wrote no reward.txt or reward.json``, ..."""
    return re.split(r": |; | \(", text, maxsplit=1)[0].strip() or "verifier error"


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """Append one record as one line, in one write, fsynced."""
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """Records of a jsonl file; a torn (unterminated, unparsable) last line is skipped."""
    p = Path(path)
    if not p.exists():
        return
    with p.open("rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                try:
                    yield json.loads(raw)
                except json.JSONDecodeError:
                    pass  # torn by a crash mid-write
                return
            if raw.strip():
                yield json.loads(raw)


def write_trajectories(path: str | Path, trajectories: list[Trajectory]) -> None:
    """Write a whole file atomically (temp file in the same folder, then rename)."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    with tmp.open("w") as f:
        for t in trajectories:
            f.write(json.dumps(t.to_dict(), separators=(",", ":")) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)
