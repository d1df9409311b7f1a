"""The agent loop: a policy drives one persistent bash shell until it submits or a limit ends it.

Each turn the policy answers the history; the harness extracts one command (a native
``bash`` tool call, or exactly one fenced ```bash block in the text protocol), runs it in the
sandbox's persistent shell and appends the observation: the output's head and tail with a
note of what was cut, then the exit code. Control flow uses exceptions that carry how the
episode ends (mini-swe-agent style). The episode ends when

- a command's output starts with the submit marker line (``submitted``);
- the step limit is reached (``step_limit``: tool calls and format errors both count);
- the episode budget, counted from the lease grant, runs out (``time_budget``);
- too many format errors follow each other (``format_errors``);
- the policy cannot go on (``context_limit``, ``policy_error``);
- a command is OOM-killed (``oom``; the agent's own processes ran out of memory).

Infrastructure failures (``sandfleet.errors.InfraError``, ``PolicyUnavailable``) are not
caught here: they propagate to the rollout, which records them.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from tmax.agent.config import AgentConfig
from tmax.agent.policy import Completion, ContextLimit, Policy, PolicyError, ToolCall

BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run one command in a persistent bash shell and return its output "
                       "and exit code.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The command."}},
            "required": ["command"],
        },
    },
}
FENCE_RE = re.compile(r"```(?:bash|sh|shell)?[ \t]*\n(.*?)\n?```", re.DOTALL)
POLICY_ENDS = ("submitted", "step_limit", "time_budget", "format_errors", "context_limit",
               "policy_error", "oom")


class Shell(Protocol):
    """What the harness needs of a sandbox: a persistent shell."""

    async def run(self, command: str, timeout: float) -> Any:
        """An object with ``output``, ``exit_code``, ``timed_out``, ``oom``."""
        ...


class _End(Exception):
    def __init__(self, reason: str, detail: str = ""):
        self.reason, self.detail = reason, detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


class FormatError(Exception):
    """The reply held no usable command; the message tells the model what to fix."""


@dataclass
class Step:
    """One executed command (or one format error)."""

    command: str | None
    exit_code: int | None = None
    timed_out: bool = False
    seconds: float = 0.0
    format_error: str = ""


@dataclass
class Episode:
    """The agent phase of one rollout, filled in as it runs (so it survives a failure)."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    end_reason: str = ""
    end_detail: str = ""
    format_errors: int = 0
    policy_seconds: float = 0.0
    shell_seconds: float = 0.0

    @property
    def n_commands(self) -> int:
        return sum(1 for s in self.steps if s.command is not None)


def truncate(output: str, head: int, tail: int) -> str:
    """Keep the first ``head`` and last ``tail`` characters, noting how many were cut."""
    if len(output) <= head + tail:
        return output
    cut = len(output) - head - tail
    end = output[len(output) - tail:] if tail else ""
    return f"{output[:head]}\n[... {cut} characters cut ...]\n{end}"


def observation(result: Any, config: AgentConfig, timeout: float) -> str:
    """What the model sees of a command's result."""
    text = truncate(result.output or "", config.observation_head_chars,
                    config.observation_tail_chars).rstrip("\n")
    notes = []
    if result.timed_out:
        notes.append(f"[the command timed out after {timeout:g} s and was killed; "
                     "the shell is still usable]")
    if result.oom:
        notes.append("[a process was killed: out of memory]")
    body = "\n".join([text, *notes]) if text else "\n".join(notes) or "[no output]"
    return f"{body}\n[exit code: {result.exit_code}]"


def parse_text_command(content: str) -> str:
    """The one command of a text-protocol reply; FormatError otherwise."""
    blocks = FENCE_RE.findall(content or "")
    if len(blocks) != 1:
        raise FormatError(f"found {len(blocks)} ```bash blocks, expected exactly one")
    command = blocks[0].strip()
    if not command:
        raise FormatError("the ```bash block is empty")
    return command


def tool_command(call: ToolCall) -> str:
    if call.name != "bash":
        raise FormatError(f"unknown tool {call.name!r}; the only tool is bash")
    try:
        command = call.args().get("command")
    except ValueError as e:
        raise FormatError(f"tool arguments are not a JSON object: {e}") from None
    if not isinstance(command, str) or not command.strip():
        raise FormatError("the bash tool needs a non-empty 'command' string")
    return command


class Agent:
    """Runs one episode: ``await Agent(policy, shell, config).run(instruction, deadline)``."""

    def __init__(self, policy: Policy, shell: Shell, config: AgentConfig):
        self.policy, self.shell, self.config = policy, shell, config
        self._first = 0
        """Where this instruction's steps start in ``episode.steps`` (the step limit's)."""
        self.use_tools = config.protocol == "tools" or (
            config.protocol == "auto" and policy.supports_tools)
        self.episode = Episode()

    def initial_messages(self, instruction: str) -> list[dict[str, Any]]:
        c = self.config
        system = c.system_template.format(**c.fields(instruction))
        if not self.use_tools:
            system += "\n\n" + c.text_protocol_template.format(**c.fields(instruction))
        return [{"role": "system", "content": system},
                {"role": "user", "content": c.instance_template.format(**c.fields(instruction))}]

    async def run(self, instruction: str, deadline: float) -> Episode:
        """Loop until the episode ends; ``deadline`` is a ``time.time()`` value.

        The episode record is complete whatever is raised (infra errors propagate)."""
        self.episode.messages = self.initial_messages(instruction)
        return await self._loop(deadline)

    async def resume(self, instruction: str, deadline: float) -> Episode:
        """Go on in the same conversation with a new instruction (a multi-step task's next
        step: the instance template around it, as a user message); the step limit counts
        afresh, the episode record goes on."""
        c = self.config
        self.episode.messages.append(
            {"role": "user", "content": c.instance_template.format(**c.fields(instruction))})
        return await self._loop(deadline)

    async def _loop(self, deadline: float) -> Episode:
        ep = self.episode
        ep.end_reason, ep.end_detail, self._first = "", "", len(ep.steps)
        try:
            while True:
                await self.step(deadline)
        except _End as end:
            ep.end_reason, ep.end_detail = end.reason, end.detail
        except ContextLimit as e:
            ep.end_reason, ep.end_detail = "context_limit", e.reason
        except PolicyError as e:
            ep.end_reason, ep.end_detail = "policy_error", e.reason
        return ep

    def _left(self, deadline: float) -> float:
        left = deadline - time.time()
        if left <= 0:
            raise _End("time_budget", "the episode's time budget ran out")
        return left

    async def step(self, deadline: float) -> None:
        ep, c = self.episode, self.config
        self._left(deadline)
        t0 = time.monotonic()
        completion = await self.policy.complete(ep.messages, [BASH_TOOL] if self.use_tools
                                                else None)
        ep.policy_seconds += time.monotonic() - t0
        ep.completions.append(completion)
        ep.messages.append(completion.message())
        try:
            commands = self._commands(completion)
        except FormatError as e:
            self._format_error(completion, str(e))
            return
        for i, (call_id, command) in enumerate(commands):
            try:
                await self._run_one(call_id, command, deadline)
            except _End:  # every tool call needs an answer in the history (a next step
                answered = {m.get("tool_call_id") for m in  # of a multi-step task goes on)
                            ep.messages[-len(commands):] if m.get("role") == "tool"}
                for later, _ in commands[i:]:
                    if later is not None and later not in answered:
                        ep.messages.append({"role": "tool", "tool_call_id": later,
                                            "content": "[not run: the episode ended first]"})
                raise
        if len(ep.steps) - self._first >= c.step_limit:
            raise _End("step_limit", f"{c.step_limit} steps")

    async def _run_one(self, call_id: str | None, command: str, deadline: float) -> None:
        ep, c = self.episode, self.config
        if len(ep.steps) - self._first >= c.step_limit:
            raise _End("step_limit", f"{c.step_limit} steps")
        timeout = min(c.command_timeout_s, self._left(deadline))
        t1 = time.monotonic()
        result = await self.shell.run(command, timeout)
        took = time.monotonic() - t1
        ep.shell_seconds += took
        ep.steps.append(Step(command, result.exit_code, result.timed_out, round(took, 3)))
        text = observation(result, c, timeout)
        if call_id is None:
            ep.messages.append({"role": "user", "content": text})
        else:
            ep.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        first = (result.output or "").lstrip().split("\n", 1)[0].strip()
        if first == c.submit_marker:
            raise _End("submitted")
        if result.oom:
            raise _End("oom", command[:200])

    def _commands(self, completion: Completion) -> list[tuple[str | None, str]]:
        if self.use_tools:
            if not completion.tool_calls:
                raise FormatError("no bash tool call in the reply")
            commands: list[tuple[str | None, str]] = [
                (call.id, tool_command(call)) for call in completion.tool_calls]
        else:
            commands = [(None, parse_text_command(completion.content))]
        if any("\x00" in command for _, command in commands):
            raise FormatError("the command contains a NUL byte, which no shell accepts")
        return commands

    def _format_error(self, completion: Completion, error: str) -> None:
        ep, c = self.episode, self.config
        ep.format_errors += 1
        ep.steps.append(Step(None, format_error=error))
        text = c.format_error_template.format(**c.fields(), error=error)
        if completion.tool_calls:  # every tool call needs an answer in the history
            for call in completion.tool_calls:
                ep.messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
        else:
            ep.messages.append({"role": "user", "content": text})
        consecutive = 0
        for step in reversed(ep.steps):
            if not step.format_error:
                break
            consecutive += 1
        if consecutive >= c.max_format_errors:
            raise _End("format_errors", f"{consecutive} format errors in a row")
        if len(ep.steps) - self._first >= c.step_limit:
            raise _End("step_limit", f"{c.step_limit} steps")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:12]}"
