"""Policies without a model: ``oracle``, ``nop`` and ``scripted``.

They keep no state between calls (the turn number is the count of assistant messages in
the history), so one instance serves any number of concurrent episodes. They answer in the
text protocol, or with native tool calls when the harness offers tools.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tmax.agent.config import SUBMIT_MARKER
from tmax.agent.policy import Completion, ToolCall


def _turn(messages: list[dict[str, Any]]) -> int:
    return sum(1 for m in messages if m.get("role") == "assistant")


def reply(command: str, tools: list[dict[str, Any]] | None, turn: int) -> Completion:
    """A completion that runs ``command`` (a fenced block, or a bash tool call)."""
    if tools:
        return Completion("", tool_calls=[ToolCall(f"call_{turn}", "bash",
                                                   json.dumps({"command": command}))])
    return Completion(f"```bash\n{command}\n```")


class ScriptedPolicy:
    """Replays given replies in order: each a command string, or a raw dict
    ``{"content": ..., "tool_calls": [...]}`` to drive format errors. After the script it
    submits."""

    supports_tools = True

    def __init__(self, replies: list[str | dict[str, Any]], *, name: str = "scripted",
                 submit_marker: str = SUBMIT_MARKER):
        self.replies, self.name, self.marker = list(replies), name, submit_marker

    @classmethod
    def from_file(cls, path: str | Path) -> ScriptedPolicy:
        """A JSON list of replies, or a text file with one command per line."""
        text = Path(path).read_text()
        if text.lstrip().startswith("["):
            return cls(json.loads(text), name=f"scripted:{Path(path).name}")
        return cls([line for line in text.splitlines() if line.strip()],
                   name=f"scripted:{Path(path).name}")

    async def complete(self, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None = None) -> Completion:
        turn = _turn(messages)
        if turn >= len(self.replies):
            return reply(f"echo {self.marker}", tools, turn)
        item = self.replies[turn]
        if isinstance(item, str):
            return reply(item, tools, turn)
        calls = [ToolCall(c.get("id", f"call_{turn}_{i}"), c.get("name", "bash"),
                          c["arguments"] if isinstance(c.get("arguments"), str)
                          else json.dumps(c.get("arguments", {})))
                 for i, c in enumerate(item.get("tool_calls", []))]
        return Completion(item.get("content", ""), reasoning=item.get("reasoning", ""),
                          tool_calls=calls)


class NopPolicy(ScriptedPolicy):
    """Submits at once (a task's reward floor)."""

    def __init__(self, *, submit_marker: str = SUBMIT_MARKER):
        super().__init__([], name="nop", submit_marker=submit_marker)


class OraclePolicy(ScriptedPolicy):
    """Copies the task's solution/ to /solution, runs solve.sh, then submits."""

    def __init__(self, *, submit_marker: str = SUBMIT_MARKER):
        super().__init__(["bash /solution/solve.sh"], name="oracle",
                         submit_marker=submit_marker)

    async def start_episode(self, episode: Any) -> None:
        await episode.sandbox.put_file(episode.task.solution_dir, "/solution")
