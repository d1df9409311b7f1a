"""One rollout: lease a sandbox of the task's image, run the agent, verify, record.

Phases and their timings (``Trajectory.timings``): ``queue`` (waiting for a free slot),
``start`` (the sandbox starting), ``agent`` (policy turns + commands; the episode budget
starts at the grant), ``verifier`` (test.sh through the fleet's ``verify``, the reward read).

Infrastructure failures (the fleet's ``InfraError`` family, an unreachable policy endpoint)
are caught here, at the boundary, and recorded as ``infra_failure`` with their cause; the
trajectory keeps whatever the episode had done. Everything else the policy did is a result.
An unexpected exception (a bug) is logged with its traceback and recorded as
``infra_failure`` with cause ``internal_error``: masked in training, re-run in evaluation,
counted in the infra-failure rate, so one bad episode never ends a long run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandfleet.errors import ImageMissing, InfraError
from tmax.agent.config import AgentConfig
from tmax.agent.harness import Agent, Episode
from tmax.agent.policy import Policy, PolicyUnavailable, start_episode
from tmax.rollout.trajectory import Trajectory, Turn
from tmax.tasks.model import Task
from tmax.tasks.reward import VerifierError, read_reward

log = logging.getLogger(__name__)
VERIFY_ENDS = ("submitted",)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class LeaseShell:
    """The harness's ``Shell`` (and file transfer) over a fleet lease."""

    def __init__(self, lease: Any):
        self.lease = lease

    async def run(self, command: str, timeout: float):
        return await self.lease.run(command, timeout=timeout)

    async def put_file(self, src: Path, dest: str) -> None:
        await self.lease.put_file(src, dest)

    async def get_file(self, src: str, dest: Path) -> Path:
        return await self.lease.get_file(src, dest)

    async def verify(self, tests: Path, command: list[str], **kwargs: Any):
        return await self.lease.verify(tests, command, **kwargs)


@dataclass
class EpisodeContext:
    """What a policy's ``start_episode`` hook sees."""

    task: Task
    sandbox: LeaseShell
    trial: int


class TaskImages:
    """Task -> SIF path in an image store (looked up once per task; never builds)."""

    def __init__(self, store: str | Path):
        from tmax.images import open_builds

        self.builds = open_builds(store, check=False)
        self._found: dict[str, tuple[str, str]] = {}

    def resolve(self, task: Task) -> tuple[str, str]:
        """``(sif_path, workdir)``; ``ImageMissing`` (an infra error) when not built."""
        if task.task_id not in self._found:
            digest = self.builds.plan(task).digest
            entry = self.builds.store.task_image(task.task_id, digest)
            self._found[task.task_id] = (str(self.builds.store.path(entry.sif)), entry.workdir)
        return self._found[task.task_id]


async def rollout(task: Task, policy: Policy, fleet: Any, images: TaskImages,
                  config: AgentConfig, *, trial: int = 0, attempt: int = 0,
                  lease_ttl_s: float | None = None) -> Trajectory:
    """Run one episode of ``task`` with ``policy`` in a sandbox leased from ``fleet``
    (a ``sandfleet.client.AsyncFleetClient``). Never raises for infra or policy failures:
    the trajectory records them."""
    meta = task.config.metadata
    traj = Trajectory(task=task.task_id, policy=policy.name, trial=trial, attempt=attempt,
                      domain=meta.domain or "", difficulty=meta.difficulty)
    t0 = time.monotonic()
    episode: Episode | None = None
    try:
        sif, workdir = await asyncio.to_thread(images.resolve, task)
        traj.image = sif
        env = task.config.environment
        t_ask = time.monotonic()
        async with fleet.lease(sif, cpus=env.cpus, memory_mb=env.memory_mb,
                               storage_mb=env.storage_mb, network=env.network,
                               ttl_s=lease_ttl_s,
                               workdir=workdir) as lease:
            granted = time.monotonic()
            traj.node = lease.grant.node
            traj.timings["queue"] = round(lease.grant.queued_s, 4)
            traj.timings["start"] = round(max(0.0, granted - t_ask - lease.grant.queued_s), 4)
            shell = LeaseShell(lease)
            probe = await shell.run('printf %s "$PATH"', 30)
            base_path = probe.output.strip() or DEFAULT_PATH
            budget = config.episode_budget_s or task.config.agent.timeout_sec
            deadline = lease.grant.granted_at + budget
            agent = Agent(policy, shell, config)
            episode = agent.episode
            await start_episode(policy, EpisodeContext(task, shell, trial))
            await agent.run(task.instruction, deadline)
            t_agent = time.monotonic()
            traj.timings["agent"] = round(t_agent - granted, 4)
            if episode.end_reason in VERIFY_ENDS or config.verify_unfinished:
                await _verify(traj, task, shell, workdir, base_path)
                traj.timings["verifier"] = round(time.monotonic() - t_agent, 4)
            else:
                traj.policy_failure = episode.end_reason
                traj.reward = 0.0
    except (InfraError, PolicyUnavailable) as e:
        traj.infra_failure = e.to_dict()
        traj.reward = None
        log.info("%s trial %d: infra failure %s", task.task_id, trial, e)
    except Exception as e:  # the rollout boundary: one bad episode must not end a run
        log.exception("%s trial %d: unexpected error in the rollout", task.task_id, trial)
        traj.infra_failure = {"error": type(e).__name__, "cause": "internal_error",
                              "message": f"{type(e).__name__}: {e}"}
        traj.reward = None
    finally:
        if episode is not None:
            _record_episode(traj, episode)
        traj.timings["total"] = round(time.monotonic() - t0, 4)
    return traj


def _record_episode(traj: Trajectory, ep: Episode) -> None:
    traj.messages = list(ep.messages)
    traj.end_reason = ep.end_reason or traj.end_reason
    traj.steps = ep.n_commands
    traj.format_errors = ep.format_errors
    traj.prompt_tokens = sum(c.prompt_tokens for c in ep.completions)
    traj.completion_tokens = sum(c.completion_tokens for c in ep.completions)
    traj.turns = [Turn(c.prompt_ids, c.completion_ids, c.logprobs or [], c.policy_version)
                  for c in ep.completions
                  if c.prompt_ids is not None and c.completion_ids is not None]


async def _verify(traj: Trajectory, task: Task, shell: LeaseShell, workdir: str,
                  base_path: str) -> None:
    """Run test.sh through the fleet's ``verify`` and read the reward it wrote.

    The verifier gets tests/ as /tests and a fresh /logs/verifier that only it can write,
    in a process tree of its own (on the local runtime: the agent's processes cannot see,
    signal or trace it, and /usr, /bin, /lib and the loader's and interpreters' files in
    /etc are the image's as built, unless the task sets ``[verifier] agent_system``).
    test.sh runs as ``/bin/bash`` in the task's workdir with the PATH the sandbox had
    before the agent started, plus the task's verifier env.
    """
    verifier = task.config.verifier
    env = {"PATH": base_path, **verifier.env}
    with tempfile.TemporaryDirectory(prefix="tmax-verify-") as tmp:
        result, got = await shell.verify(task.tests_dir, ["/bin/bash", "/tests/test.sh"],
                                         timeout=verifier.timeout_sec,
                                         dest=Path(tmp) / "verifier", cwd=workdir, env=env,
                                         agent_system=verifier.agent_system)
        traj.verifier_output = result.output[-4000:]
        if result.timed_out:
            traj.verifier_error = f"test.sh timed out after {verifier.timeout_sec:g} s"
            return
        try:
            traj.reward = read_reward(got, task.task_id)
            metrics = got / "reward.json"
            if metrics.is_file():
                data = json.loads(metrics.read_text())
                traj.reward_metrics = {k: float(v) for k, v in data.items()
                                       if isinstance(v, (int, float))}
        except VerifierError as e:
            traj.verifier_error = e.reason


__all__ = ["EpisodeContext", "ImageMissing", "LeaseShell", "TaskImages", "rollout"]
