"""Policies without a model: ``oracle``, ``nop`` and ``scripted``.

They keep no state between calls (the turn number is the count of assistant messages in
the history), so one instance serves any number of concurrent episodes. They answer in the
text protocol, or with native tool calls when the harness offers tools.
"""

from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path
from typing import Any

from tmax.agent.config import SUBMIT_MARKER
from tmax.agent.policy import Completion, ToolCall
from tmax.tasks.model import MissingSolution

log = logging.getLogger(__name__)


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
    """The task's reference solution, run as the build-time checks run it
    (``tmax.images.checks``), then a submit: before the first turn, solution/ is copied to
    /solution and ``bash /solution/solve.sh`` runs in the task's working directory (a
    subshell: the agent's shell stays where it was) under the task's agent timeout, not the
    harness's per-command one. On a multi-step task, each step's ``solution/`` the same way
    before that step's turns, under the step's timeout (``start_step``).

    ``MissingSolution`` for a task (or step) without one: there is nothing to run."""

    needs_solution = True
    """Evaluation skips tasks without a reference solution (``tmax.eval.runner.preflight``)."""

    def __init__(self, *, submit_marker: str = SUBMIT_MARKER):
        super().__init__([], name="oracle", submit_marker=submit_marker)

    async def start_episode(self, episode: Any) -> None:
        task = episode.task
        if task.steps:  # each step's own, in start_step
            return
        if not task.has_solution:
            raise MissingSolution(task.task_id)
        await solve(episode, task.solution_dir, task.config.agent.timeout_sec)

    async def start_step(self, episode: Any, step: Any) -> None:
        if not step.solve_script.is_file():
            raise MissingSolution(episode.task.task_id)
        await solve(episode, step.solve_script.parent, step.agent_timeout_sec)


async def solve(episode: Any, solution: Path, timeout: float) -> Any:
    """``solution`` copied to /solution and its solve.sh run in the episode's working
    directory; the command's result (its exit status is not judged: the verifier is)."""
    await episode.sandbox.put_file(solution, "/solution")
    where = shlex.quote(episode.workdir or "/")
    result = await episode.sandbox.run(f"(cd {where} && bash /solution/solve.sh)", timeout)
    log.debug("%s: solve.sh exited %s%s", episode.task.task_id, result.exit_code,
              " (timed out)" if result.timed_out else "")
    return result
