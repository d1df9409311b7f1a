"""mini-swe-agent 2.x in fleet sandboxes: ``SandfleetEnvironment``.

mini picks its environment by import path, so its own agent runs in a leased sandbox with::

    mini -c mini.yaml -c examples/mini/sandfleet.yaml -t "..."    # environment_class below

    # or in Python
    from minisweagent.environments import get_environment
    env = get_environment({"environment_class": "tmax.agent.mini.SandfleetEnvironment",
                           "state_dir": "~/fleet", "image": "task.sif"})

Importing this module imports ``minisweagent`` (which prints its banner unless
``MSWEA_SILENT_STARTUP`` is set); nothing else in ``tmax`` imports it.

Behaviour next to mini's own environments (``local``, ``docker``, ``singularity``):

- One lease per environment, acquired in ``__init__`` and released by ``close()`` (also
  ``stop()``, ``cleanup()``, the ``with`` block's end, and at interpreter exit through
  ``atexit``, since mini's CLI never cleans its environment up). Nothing is released in
  ``__del__``. While the process lives the client renews the lease in the background; if
  the process dies, renewals stop and the lease's TTL (``lease_ttl_s``, else the fleet's
  default) is the deadline by which the fleet destroys the sandbox.
- Commands run in the lease's *persistent* shell: ``cd``, variables and background jobs carry
  over between actions (mini's own environments start a fresh shell per action; commands
  written for those still work here). ``config.cwd`` and ``config.env`` are the shell's
  start directory and environment. An explicit ``execute(..., cwd=...)`` moves the shell
  there first (and it stays there).
- ``execute`` returns mini's dict: ``output``, ``returncode``, ``exception_info`` and
  ``extra``. A timeout reads as mini's ``local`` environment reports one: ``returncode`` -1,
  ``exception_info`` "An error occurred while executing the command: Command '...' timed out
  after N seconds", ``extra.exception_type`` ``TimeoutExpired``, with the output so far. The
  fleet killed the command's processes, and the shell (cwd, variables, older jobs) is as it
  was, so the next action runs in it. An OOM kill is a result too: ``exception_info`` says so.
- Submission as in mini: an output whose first line is ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``
  from a command that exited 0 raises ``Submitted`` with the rest as the submission.
- Infrastructure failures are *not* outputs: ``sandfleet.errors.InfraError`` (``SandboxLost``,
  ``NodeLost``...) and ``LeaseClosed`` propagate out of ``execute``. Returned as an output,
  mini would show the model an error, let it carry on in a sandbox that is gone, and score
  the episode as the agent's own failure; raised, mini's agent records the exception's class
  name as the exit status, saves the trajectory and re-raises, so the caller can count it as
  an infra failure and mask it.
"""

from __future__ import annotations

import atexit
import logging
import platform
import shlex
import subprocess
from typing import Any, Self

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel, ConfigDict, Field

from sandfleet import ExecResult, FleetClient

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
"""The first output line by which a mini agent submits (``echo SUBMIT_MARKER``)."""

_UNAME_KEYS = ("system", "node", "release", "version", "machine")
_UNAME_COMMAND = "uname -s; uname -n; uname -r; uname -v; uname -m"


class SandfleetEnvironmentConfig(BaseModel):
    """The keyword arguments of ``SandfleetEnvironment`` (the YAML ``environment`` section
    without ``environment_class``); unknown keys are an error."""

    model_config = ConfigDict(extra="forbid")

    state_dir: str
    """The fleet's state directory (``sandfleet up --state-dir``)."""
    image: str
    """Path of the SIF image to start the sandbox from."""
    cwd: str = "/"
    """The shell's start directory in the sandbox."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables of the sandbox's shell."""
    timeout: int = 120
    """Seconds a command may run (``execute(timeout=...)`` overrides it for one command)."""
    cpus: int = 2
    """CPUs of the sandbox."""
    memory_mb: int = 2048
    """Memory limit of the sandbox in MiB."""
    lease_ttl_s: float | None = None
    """Seconds the fleet keeps the sandbox once renewals stop (this process died); the
    fleet's ``lease_ttl_s`` when None."""
    network: bool = False
    """Whether the sandbox has network access."""
    allowed_hosts: list[str] = Field(default_factory=list)
    """The allowlist network instead (``sandfleet.netproxy``): only these hosts, over
    http/https through the fleet's proxy (e.g. ``sandfleet.netproxy.REGISTRY_HOSTS``)."""


class SandfleetEnvironment:
    """mini-swe-agent's ``Environment`` on one fleet lease; see the module docstring."""

    def __init__(self, *, config_class: type = SandfleetEnvironmentConfig,
                 logger: logging.Logger | None = None, **kwargs: Any):
        self.config = config_class(**kwargs)
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self._uname: dict[str, str] | None = None
        self._closed = False
        self.client = FleetClient(self.config.state_dir)
        try:
            self.lease = self.client.acquire(
                self.config.image, cpus=self.config.cpus, memory_mb=self.config.memory_mb,
                ttl_s=self.config.lease_ttl_s, network=self.config.network,
                allowed_hosts=self.config.allowed_hosts,
                env=self.config.env, workdir=self.config.cwd)
        except BaseException:
            self.client.close()
            raise
        atexit.register(self.close)
        self.logger.info("sandfleet lease %s on %s", self.lease.lease_id, self.lease.node)

    # ---- mini's Environment protocol

    def execute(self, action: dict | str, cwd: str = "", *,
                timeout: int | None = None) -> dict[str, Any]:
        """Run ``action["command"]`` (or a command string) in the lease's shell; mini's
        result dict. Raises ``Submitted`` on the submit marker; infra errors propagate."""
        command = action if isinstance(action, str) else action.get("command", "")
        limit = timeout or self.config.timeout
        if cwd:
            moved = self.lease.run(f"cd -- {shlex.quote(cwd)}", timeout=limit)
            if moved.exit_code != 0 or moved.timed_out:
                return _as_output(moved, command, limit, self.config.memory_mb)
        output = _as_output(self.lease.run(command, timeout=limit), command, limit,
                            self.config.memory_mb)
        _check_submitted(output)
        return output

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """The config and the sandbox's ``uname`` (``system``, ``release``, ``version``,
        ``machine``: mini's prompts use them) merged with ``kwargs``."""
        return recursive_merge(self.config.model_dump(), self.uname(), kwargs)

    def serialize(self) -> dict:
        return {"info": {
            "config": {
                "environment": self.config.model_dump(mode="json"),
                "environment_type": f"{type(self).__module__}.{type(self).__name__}",
            },
            "sandfleet": {"lease_id": self.lease.lease_id, "sandbox_id": self.lease.sandbox_id,
                          "node": self.lease.node, "worker": self.lease.worker_address},
        }}

    # ---- the sandbox

    def uname(self) -> dict[str, str]:
        """The sandbox's ``uname`` fields (asked once); the host's if it has no ``uname``."""
        if self._uname is None:
            result = self.lease.run(_UNAME_COMMAND, timeout=30)
            lines = result.output.splitlines()
            if result.exit_code == 0 and len(lines) == len(_UNAME_KEYS):
                self._uname = dict(zip(_UNAME_KEYS, lines))
            else:
                self._uname = {k: getattr(platform.uname(), k) for k in _UNAME_KEYS}
        return self._uname

    def close(self) -> None:
        """Release the lease (the fleet destroys its sandbox) and stop the client; idempotent."""
        atexit.unregister(self.close)
        if self._closed:
            return
        self._closed = True
        try:
            self.lease.release(quiet=True)
        finally:
            self.client.close()

    stop = close
    cleanup = close  # the name mini's docker and singularity environments use

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_output(result: ExecResult, command: str, timeout: int, memory_mb: int) -> dict[str, Any]:
    """mini's result dict for a sandfleet ``ExecResult`` (timeouts as mini's ``local``)."""
    output: dict[str, Any] = {
        "output": result.output, "returncode": result.exit_code, "exception_info": "",
        "extra": {"exit_code": result.exit_code, "duration_s": result.duration_s},
    }
    if result.timed_out:
        error = subprocess.TimeoutExpired(command, timeout)
        output["returncode"] = -1
        output["exception_info"] = f"An error occurred while executing the command: {error}"
        output["extra"] |= {"exception_type": "TimeoutExpired", "exception": str(error)}
    elif result.oom:
        output["exception_info"] = (f"The command was killed: the sandbox ran out of memory "
                                    f"({memory_mb} MiB).")
        output["extra"] |= {"exception_type": "OutOfMemory", "oom": True}
    return output


def _check_submitted(output: dict[str, Any]) -> None:
    """Raise ``Submitted`` when the output opens with the submit marker and exited 0."""
    lines = output["output"].lstrip().splitlines(keepends=True)
    if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
        submission = "".join(lines[1:])
        raise Submitted({"role": "exit", "content": submission,
                         "extra": {"exit_status": "Submitted", "submission": submission}})


__all__ = ["SUBMIT_MARKER", "SandfleetEnvironment", "SandfleetEnvironmentConfig"]
