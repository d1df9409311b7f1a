"""The agent's settings and prompts: a strict model loaded from YAML (configs/agent.yaml).

Prompts are Python ``str.format`` templates. Fields they may use:
``{instruction}``, ``{submit}`` (the submit command), ``{step_limit}``,
``{command_timeout}``; the format-error template also gets ``{error}``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tmax.package_data import CONFIGS

SUBMIT_MARKER = "TMAX_TASK_COMPLETE"


class AgentConfigError(Exception):
    def __init__(self, path: str, problems: list[str]):
        self.path, self.problems = path, problems
        super().__init__(f"{path}: " + "; ".join(problems))


class AgentConfig(BaseModel):
    """How the harness drives a policy in a sandbox."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    system_template: str = Field(
        "You are an expert at the Linux command line, working in a sandboxed terminal. "
        "You act only through the bash tool: one command per turn, run in a persistent "
        "shell (your working directory, environment and background jobs carry over). "
        "Commands time out after {command_timeout:g} seconds. When the task is done, run "
        "`{submit}` alone as your last command.",
        description="System prompt.")
    instance_template: str = Field(
        "Task:\n\n{instruction}\n\nYou have at most {step_limit} commands.",
        description="First user message.")
    text_protocol_template: str = Field(
        "Reply with a short thought, then exactly one command in a fenced block:\n\n"
        "```bash\n<command>\n```",
        description="Appended to the system prompt when the policy has no native tool calls.")
    format_error_template: str = Field(
        "Format error: {error}\nReply with exactly one ```bash``` block holding one command "
        "(or run `{submit}` when you are done).",
        description="User message after a reply the harness cannot parse.")
    protocol: Literal["auto", "tools", "text"] = Field(
        "auto", description="tools = native tool calls; text = one fenced bash block; "
        "auto = tools when the policy supports them.")
    step_limit: int = Field(64, ge=1, description="Most tool calls (and format errors).")
    command_timeout_s: float = Field(120.0, gt=0, description="Per-command timeout.")
    episode_budget_s: float | None = Field(
        None, gt=0, description="Wall time from the lease grant to the end of the agent "
        "phase; default: the task's [agent] timeout_sec.")
    max_format_errors: int = Field(
        8, ge=1, description="Consecutive format errors that end the episode.")
    observation_head_chars: int = Field(4000, ge=0, description="Output head kept.")
    observation_tail_chars: int = Field(4000, ge=0, description="Output tail kept.")
    submit_marker: str = Field(
        SUBMIT_MARKER, min_length=1, description="The episode ends when a command's "
        "output starts with this line; the prompts tell the agent to run `echo <marker>`.")
    verify_unfinished: bool = Field(
        False, description="Run the verifier after a step-limit or time-budget end too "
        "(Terminal-Bench style); default: such episodes score 0 without verifying.")
    agent_network: Literal["offline", "registries"] = Field(
        "registries", description="The agent's network for a Harbor task that says nothing "
        "about it (Harbor runs those online): registries = the package registries only "
        "(Debian and Ubuntu archives, PyPI, npm) through the fleet's proxy; offline = none. "
        "Tasks that say what they need get that (an allowlist is enforced the same way); the "
        "verifier is offline either way.")

    @property
    def submit_command(self) -> str:
        return f"echo {self.submit_marker}"

    def fields(self, instruction: str = "") -> dict[str, object]:
        return {"instruction": instruction, "submit": self.submit_command,
                "step_limit": self.step_limit, "command_timeout": self.command_timeout_s}


def load_agent_config(path: str | Path | None = None, **overrides: object) -> AgentConfig:
    """Read an agent config (default configs/agent.yaml when present, else the defaults)."""
    if path is None and (CONFIGS / "agent.yaml").is_file():
        path = CONFIGS / "agent.yaml"
    data: dict = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise AgentConfigError(str(path), [str(e)]) from None
        if not isinstance(data, dict):
            raise AgentConfigError(str(path), ["expected a mapping of settings"])
    try:
        return AgentConfig.model_validate({**data, **overrides})
    except ValidationError as e:
        raise AgentConfigError(str(path or "<defaults>"), [
            f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]) from None
