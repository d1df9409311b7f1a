"""The policy seam: what the harness asks of a model, and what a model answers.

A policy is any object with ``name``, ``supports_tools`` and an async ``complete``. It
gets the chat history (OpenAI message dicts) and, when it supports native tool calls, the
tool schema; it returns a ``Completion``. Policies that can (local transformers, vLLM)
also return the exact token ids of the prompt and of the completion with the per-token
log-probs of the sampled tokens, so a trainer can learn from the same rollout.

``start_episode`` is an optional hook called once the sandbox is ready (the oracle runs
the reference solution there); ``start_step`` one called before each step of a multi-step
task, after its setup (the oracle runs that step's solution).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable


class PolicyError(Exception):
    """The policy could not answer (bad response, context too long); a policy outcome."""

    def __init__(self, policy: str, reason: str):
        self.policy, self.reason = policy, reason
        super().__init__(f"policy {policy}: {reason}")


class ContextLimit(PolicyError):
    """The history no longer fits the model's context; the episode ends (policy outcome)."""


class PolicyUnavailable(Exception):
    """The policy's endpoint failed for reasons outside the policy (transport errors, 5xx
    after every retry). Rollouts record it as an infrastructure failure
    (cause ``policy_unavailable``): it is re-run in evaluation and masked in training."""

    cause = "policy_unavailable"

    def __init__(self, policy: str, reason: str):
        self.policy, self.reason = policy, reason
        super().__init__(f"policy {policy} unavailable: {reason}")

    def to_dict(self) -> dict[str, Any]:
        return {"error": type(self).__name__, "cause": self.cause, "message": str(self)}


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str
    """The raw JSON string the model produced."""

    def args(self) -> dict[str, Any]:
        """The arguments as a dict; ValueError when they are not a JSON object."""
        data = json.loads(self.arguments or "{}")
        if not isinstance(data, dict):
            raise ValueError("tool arguments must be a JSON object")
        return data


@dataclass
class Completion:
    """One assistant turn."""

    content: str
    reasoning: str = ""
    """Reasoning text (``reasoning_content``), kept in the history across turns."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str = "stop"
    prompt_ids: list[int] | None = None
    """Token ids of the whole prompt this turn was sampled from (when the policy knows)."""
    completion_ids: list[int] | None = None
    logprobs: list[float] | None = None
    """Log-prob of each completion token under the sampling policy (same length)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    policy_version: int | None = None
    """Weights version that sampled this turn (trainers bound staleness with it)."""

    def __post_init__(self) -> None:
        if self.logprobs is not None and (self.completion_ids is None
                                          or len(self.logprobs) != len(self.completion_ids)):
            raise ValueError("logprobs need completion_ids of the same length")

    def message(self) -> dict[str, Any]:
        """The assistant message to append to the history."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in self.tool_calls]
        return msg

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@runtime_checkable
class Policy(Protocol):
    name: str
    supports_tools: bool

    async def complete(self, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None = None) -> Completion:
        """The next assistant turn for ``messages``."""
        ...


async def start_episode(policy: Policy, episode: Any) -> None:
    """Call the policy's optional ``start_episode(episode)`` hook."""
    hook = getattr(policy, "start_episode", None)
    if hook is not None:
        await hook(episode)


async def start_step(policy: Policy, episode: Any, step: Any) -> None:
    """Call the policy's optional ``start_step(episode, step)`` hook."""
    hook = getattr(policy, "start_step", None)
    if hook is not None:
        await hook(episode, step)
