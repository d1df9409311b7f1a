"""One rollout: lease a sandbox of the task's image, run the agent, verify, record.

Phases and their timings (``Trajectory.timings``): ``queue`` (waiting for a free slot),
``start`` (the sandbox starting), ``agent`` (policy turns + commands; the episode budget
starts at the grant), ``verifier`` (test.sh through the fleet's ``verify``, the reward read).

Infrastructure failures (the fleet's ``InfraError`` family, an unreachable policy endpoint)
are caught here, at the boundary, and recorded as ``infra_failure`` with their cause; the
trajectory keeps whatever the episode had done. Everything else the policy did is a result.
An unexpected exception (TMax's own error, a bug) is logged and recorded as
``internal_error`` with its traceback: neither the policy's failure nor the fleet's, never
re-run as if a node had failed; evaluation and training count them and stop after a few
(``tmax.rollout.trajectory``).
A verifier that cannot grade (no reward, or a 0 from a test runner that never started:
``tmax.tasks.grading``) is a ``verifier_error``: a task problem, neither infra nor the
agent's failure.

A task with a separate verifier (Harbor's ``[verifier] environment_mode = "separate"``) hands
its artifacts (/logs/artifacts and the task's ``artifacts`` paths) from the agent's sandbox,
which is then released, to a fresh one of the verifier's image (tests/Dockerfile's, else the
task's own), where test.sh runs; the ``verifier`` timing includes that sandbox's start.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandfleet import ImageMissing, InfraError
from tmax.agent.config import AgentConfig
from tmax.agent.harness import Agent, Episode
from tmax.agent.policy import Policy, PolicyUnavailable, start_episode, start_step
from tmax.rollout.trajectory import Trajectory, Turn, internal_error
from tmax.tasks import artifacts
from tmax.tasks.environment import PROBE as ENV_PROBE
from tmax.tasks.environment import parse_probe, verifier_env
from tmax.tasks.grading import (
    CONTRADICTED,
    NEEDS_NETWORK,
    VERIFIER_TIMEOUT,
    Grade,
    decide,
    grade_problem,
)
from tmax.tasks.model import NO_BAKED_TESTS, Task
from tmax.tasks.steps import TaskStep, healthcheck_command, merged_tests, multi_step_reward

log = logging.getLogger(__name__)
VERIFY_ENDS = ("submitted",)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class LeaseShell:
    """The harness's ``Shell`` (and file transfer) over a fleet lease; ``verifier_user``:
    who ``grade`` runs test.sh as ("" for root)."""

    def __init__(self, lease: Any, verifier_user: str = ""):
        self.lease, self.verifier_user = lease, verifier_user

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
    workdir: str = ""
    """Where the task's commands start (the image's WORKDIR)."""


def plan_errors() -> tuple[type[Exception], ...]:
    """What planning a task's image raises when the task itself cannot be made into one:
    ``BaseMappingError`` (a FROM image with no local base), ``BuildError`` and
    ``ValueError`` (a definition or Dockerfile that cannot be read)."""
    from tmax.images.bases import BaseMappingError
    from tmax.images.types import BuildError

    return BaseMappingError, BuildError, ValueError


class TaskImages:
    """Task -> SIF path in an image store (looked up once per task; never builds)."""

    def __init__(self, store: str | Path, base_map: str | Path | None = None):
        """``base_map``: the user's map of images to bases the images were built with
        (default $TMAX_BASE_MAP; tmax.images.bases)."""
        from tmax.images.build import open_builds

        self.builds = open_builds(store, check=False, base_map=base_map)
        self._found: dict[tuple[str, str], Any] = {}
        self._plans: dict[tuple[str, str], Any] = {}
        self._warned: set[str] = set()

    def plan(self, task: Task) -> Any:
        """The task's build plan (``tmax.images.build.Plan``), made once per task folder."""
        key = (task.task_id, str(task.root))  # a repaired copy is another task folder
        if key not in self._plans:
            self._plans[key] = self.builds.plan(task)
        return self._plans[key]

    def _definition(self, task: Task, verifier: bool) -> Any:
        plan = self.plan(task)
        return plan.verifier_image if verifier and plan.verifier_image else plan.definition

    def user(self, task: Task, *, verifier: bool = False) -> str:
        """Who the agent's commands run as in the task's sandbox (``Plan.user``;
        ``verifier``: in a sandbox of its separate verifier, that image's final USER)."""
        plan = self.plan(task)
        return (plan.verifier_image or plan.definition).user if verifier else plan.user

    def verifier_user(self, task: Task, *, separate: bool = False) -> str:
        """Who test.sh runs as (``Plan.verifier_user``; ``separate``: in a sandbox of the
        separate verifier's image)."""
        return self.plan(task).verifier_user(separate)

    def start_command(self, task: Task, *, verifier: bool = False) -> str:
        """What a sandbox of the task's image (``verifier``: of its separate verifier's)
        runs before anything else: its ENTRYPOINT, as Harbor starts it; "" for none."""
        return self._definition(task, verifier).start_command

    def entry(self, task: Task) -> Any:
        """The store's entry (``ImageEntry``) of the task's current image. ``ImageMissing``
        when it is not built, out of date or corrupt; one of ``plan_errors()`` when no image
        can be planned from the task. Its ``checks`` say whether the build-time checks
        passed; this does not look at them."""
        key = (task.task_id, str(task.root))
        if key not in self._found:
            digest = self.plan(task).digest
            self._found[key] = self.builds.store.task_image(task.task_id, digest)
        return self._found[key]

    def resolve(self, task: Task) -> tuple[str, str]:
        """``(sif_path, workdir)``; ``ImageMissing`` (an infra error: masked in training)
        when the image is not built or cannot be planned. An image whose build-time checks
        failed is used, with a warning once per task (evaluation skips such tasks before
        it starts: ``tmax.eval.runner.preflight``)."""
        try:
            entry = self.entry(task)
        except plan_errors() as e:
            raise ImageMissing(str(task.environment_dir),
                               f"task {task.task_id}: no image can be planned: {e}") from None
        checks = entry.checks
        if checks is not None and not checks.ok and task.task_id not in self._warned:
            self._warned.add(task.task_id)
            log.warning("%s: the image's build-time checks failed (%s); its rewards may be "
                        "wrong", task.task_id, checks.reason)
        return str(self.builds.store.path(entry.sif)), entry.workdir

    def resolve_verifier(self, task: Task) -> tuple[str, str]:
        """``(sif_path, workdir)`` a separate verifier runs in: its own image (built from
        tests/Dockerfile), else a fresh copy of the task's."""
        entry = self.entry(task)
        if entry.verifier_sif:
            return str(self.builds.store.path(entry.verifier_sif)), entry.verifier_workdir
        return str(self.builds.store.path(entry.sif)), entry.workdir


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
    handoff = tempfile.TemporaryDirectory(prefix="tmax-artifacts-")
    artifacts: list[tuple[Path, str]] | None = None  # a separate verifier's, once collected
    try:
        sif, workdir = await asyncio.to_thread(images.resolve, task)
        traj.image = sif
        env = task.config.environment
        network, hosts = task.config.agent_network(config.agent_network)
        t_ask = time.monotonic()
        async with fleet.lease(sif, cpus=env.cpus, memory_mb=env.memory_mb,
                               storage_mb=env.storage_mb, network=network,
                               ttl_s=lease_ttl_s, workdir=workdir,
                               user=images.user(task), allowed_hosts=hosts) as lease:
            granted = time.monotonic()
            traj.node = lease.grant.node
            traj.timings["queue"] = round(lease.grant.queued_s, 4)
            traj.timings["start"] = round(max(0.0, granted - t_ask - lease.grant.queued_s), 4)
            shell = LeaseShell(lease, images.verifier_user(task))
            image_env = parse_probe((await shell.run(ENV_PROBE, 30)).output)
            base_path = image_env.get("PATH") or DEFAULT_PATH
            if start := images.start_command(task):  # the image's ENTRYPOINT
                await shell.run(start, 60)
            budget = config.episode_budget_s or task.config.agent.timeout_sec
            deadline = lease.grant.granted_at + budget
            agent = Agent(policy, shell, config)
            episode = agent.episode
            context = EpisodeContext(task, shell, trial, workdir)
            await start_episode(policy, context)
            if task.steps:  # agent and verifier, step by step, in this one sandbox
                await _run_steps(traj, task, agent, shell, config, workdir, base_path,
                                 image_env, context)
                traj.timings["agent"] = round(time.monotonic() - granted, 4)
                return traj
            await agent.run(task.instruction, deadline)
            t_agent = time.monotonic()
            traj.timings["agent"] = round(t_agent - granted, 4)
            if not (episode.end_reason in VERIFY_ENDS or config.verify_unfinished):
                traj.policy_failure = episode.end_reason
                traj.reward = 0.0
            elif task.separate_verifier:
                artifacts = await collect_artifacts(task, shell, Path(handoff.name))
            else:
                await _verify(traj, task, shell, workdir, base_path, image_env=image_env)
                traj.timings["verifier"] = round(time.monotonic() - t_agent, 4)
        if artifacts is not None:  # the agent's sandbox is gone: a fresh one grades
            vsif, vworkdir = await asyncio.to_thread(images.resolve_verifier, task)
            venv = task.config.verifier_resources
            async with fleet.lease(vsif, cpus=venv.cpus, memory_mb=venv.memory_mb,
                                   storage_mb=venv.storage_mb, network=venv.network,
                                   ttl_s=lease_ttl_s, workdir=vworkdir,
                                   user=images.user(task, verifier=True)) as verifier_lease:
                vshell = LeaseShell(verifier_lease,
                                    images.verifier_user(task, separate=True))
                await _verify_separately(traj, task, vshell, vworkdir,
                                         artifacts, Path(handoff.name),
                                         images.start_command(task, verifier=True))
            traj.timings["verifier"] = round(time.monotonic() - t_agent, 4)
    except (InfraError, PolicyUnavailable) as e:
        traj.infra_failure = e.to_dict()
        traj.reward = None
        log.info("%s trial %d: infra failure %s", task.task_id, trial, e)
    except Exception as e:  # the rollout boundary: TMax's own error, kept apart
        log.exception("%s trial %d: internal error in the rollout", task.task_id, trial)
        traj.internal_error = internal_error(e)
        traj.reward = None
    finally:
        if episode is not None:
            _record_episode(traj, episode)
        traj.timings["total"] = round(time.monotonic() - t0, 4)
        await asyncio.to_thread(handoff.cleanup)
    return traj


async def collect_artifacts(task: Task, shell: Any, dest: Path) -> list[tuple[Path, str]]:
    """Copy the task's ``artifacts`` that exist out of the agent's sandbox into ``dest``:
    (host copy, path in the sandbox) each. They are archived as a verifier runs (the
    agent frozen, the image's own tar) and unpacked as untrusted data
    (``tmax.tasks.artifacts``); what cannot be handed over is left out, and the verifier
    grades without it, as without one the agent did not write."""
    result, got = await shell.verify(artifacts.collector(dest / "collector"),
                                     artifacts.command(task.artifacts),
                                     timeout=artifacts.TIMEOUT_S, dest=dest / "collected",
                                     cwd="/", env={"PATH": DEFAULT_PATH})
    if result.timed_out:
        log.info("%s: collecting the artifacts timed out", task.task_id)
    return artifacts.unpack(got, task.artifacts, dest / "unpacked")


async def _verify_separately(traj: Trajectory, task: Task, shell: LeaseShell, workdir: str,
                             artifacts: list[tuple[Path, str]], scratch: Path,
                             start: str = "") -> None:
    """``grade`` in a fresh sandbox of the verifier's image (``start``: its ENTRYPOINT)
    holding ``artifacts`` at their paths; /tests as that image has it when tests/ built it
    (Harbor uploads none then)."""
    image_env = parse_probe((await shell.run(ENV_PROBE, 30)).output)
    if start:
        await shell.run(start, 60)
    tests = None
    if task.verifier_definition is not None:
        try:
            tests = await shell.get_file("/tests", scratch / "tests")
        except FileNotFoundError:
            traj.verifier_error = NO_BAKED_TESTS
            return
    for local, path in artifacts:
        await shell.put_file(local, path)
    await _verify(traj, task, shell, workdir, image_env.get("PATH") or DEFAULT_PATH, tests,
                  image_env)


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
                  base_path: str, tests: Path | None = None,
                  image_env: dict[str, str] | None = None) -> None:
    """``grade`` the episode and record the reward, or why there is none, in ``traj``."""
    g = await grade(task, shell, workdir, base_path, tests, image_env)
    traj.verifier_output = g.output
    traj.grading_note = g.note or None
    if g.reward is None:
        traj.verifier_error = g.error
        return
    if g.timed_out:
        traj.policy_failure = VERIFIER_TIMEOUT
    if g.contradicted:
        traj.policy_failure, traj.contradicted_reward = CONTRADICTED, g.contradicted
    traj.reward = g.reward
    traj.reward_metrics = g.metrics


async def _run_steps(traj: Trajectory, task: Task, agent: Agent, shell: LeaseShell,
                     config: AgentConfig, workdir: str, base_path: str,
                     image_env: dict[str, str], context: EpisodeContext) -> None:
    """A multi-step task (``tmax.tasks.steps``): for each step, its workdir/ and setup.sh,
    its healthcheck, the agent on its instruction (the conversation goes on from the last
    step's), its verifier over the merged tests. A step the agent does not finish scores 0;
    the steps after one below its ``min_reward`` do not run. The reward is
    ``multi_step_reward``'s; each step's is in ``reward_metrics`` as ``step:<name>``."""
    rewards: list[float] = []
    metrics: dict[str, float] = {}
    for step in task.steps:
        problem = await _begin_step(shell, step, workdir)
        if problem and step.index == 0:  # before the agent acted: the task's fault
            traj.verifier_error = f"step {step.name}: {problem}"
            return
        if problem:  # what the agent left fails the step's setup or precondition (never a
            # masked error it could cause on purpose): no more steps, they score 0
            log.info("%s: step %s: %s", task.task_id, step.name, problem)
            break
        await start_step(agent.policy, context, step)
        deadline = time.time() + (config.episode_budget_s or step.agent_timeout_sec)
        await (agent.resume if rewards else agent.run)(step.instruction, deadline)
        if not (agent.episode.end_reason in VERIFY_ENDS or config.verify_unfinished):
            traj.policy_failure = agent.episode.end_reason
            rewards.append(0.0)
            metrics[f"step:{step.name}"] = 0.0
            break
        with tempfile.TemporaryDirectory(prefix="tmax-step-") as tmp:
            tests = merged_tests(task, step, Path(tmp) / "tests")
            g = await grade(task, shell, workdir, base_path, tests, image_env, step)
        traj.verifier_output = g.output
        if g.note:
            traj.grading_note = "; ".join(filter(None, [traj.grading_note,
                                                        f"step {step.name}: {g.note}"]))
        if g.reward is None:
            traj.verifier_error = f"step {step.name}: {g.error}"
            return
        if g.timed_out:
            traj.policy_failure = VERIFIER_TIMEOUT
        if g.contradicted:
            traj.policy_failure = CONTRADICTED
            traj.contradicted_reward = f"step {step.name}: {g.contradicted}"
        rewards.append(g.reward)
        metrics[f"step:{step.name}"] = g.reward
        if not step.passes(g.reward, g.metrics):
            break
    traj.reward = multi_step_reward(rewards, len(task.steps),
                                    task.config.multi_step_reward_strategy)
    traj.reward_metrics = metrics


async def _begin_step(shell: LeaseShell, step: TaskStep, workdir: str) -> str:
    """The step's workdir/ into ``workdir`` and its setup.sh run there (in a subshell: the
    agent's shell stays where it was); then its healthcheck. What went wrong, or ""."""
    if step.workdir_dir.is_dir():
        await shell.put_file(step.workdir_dir, workdir)
        if (step.workdir_dir / "setup.sh").is_file():
            setup = await shell.run(f"(cd {shlex.quote(workdir)} && bash ./setup.sh)",
                                    step.agent_timeout_sec)
            if setup.exit_code != 0 or setup.timed_out:
                return f"setup.sh failed (exit {setup.exit_code}): {setup.output[-300:]}"
    if step.healthcheck is None:
        return ""
    command, attempts, interval, timeout = healthcheck_command(step.healthcheck)
    for attempt in range(attempts):
        if (await shell.run(f"({command})", timeout)).exit_code == 0:
            return ""
        if attempt + 1 < attempts:
            await asyncio.sleep(interval)
    return f"the healthcheck ({command}) failed {attempts} times"


async def grade(task: Task, shell: Any, workdir: str, base_path: str,
                tests: Path | None = None, image_env: dict[str, str] | None = None,
                step: TaskStep | None = None) -> Grade:
    """Run test.sh through the fleet's ``verify`` (``shell``: a ``LeaseShell``) and read the
    reward it wrote.

    The verifier gets tests/ as /tests and a fresh /logs/verifier that only it can write,
    in a process tree of its own (on the local runtime: the agent's processes cannot see,
    signal or trace it, and /usr, /bin, /lib and the loader's and interpreters' files in
    /etc are the image's as built, unless the task sets ``[verifier] agent_system``).
    test.sh runs as ``/bin/bash`` in the task's workdir with the image's environment
    (``image_env``: what the sandbox had before the agent started, ``tmax.tasks.environment``,
    its PATH among it) and the task's verifier env.

    What came back is graded by ``tmax.tasks.grading.decide``, as the build-time checks
    grade: a reward the verifier wrote stands (a 0 is an error only where the test runner
    never started), no reward is an error, a timeout scores 0 (``timed_out``; the rollout's
    ``policy_failure`` is ``VERIFIER_TIMEOUT``).
    """
    verifier = task.config.verifier
    env = verifier_env(image_env or {}, base_path,
                       step.verifier_env if step else verifier.env)
    timeout = step.verifier_timeout_sec if step else verifier.timeout_sec
    with tempfile.TemporaryDirectory(prefix="tmax-verify-") as tmp:
        result, got = await shell.verify(tests or task.tests_dir,
                                         ["/bin/bash", "/tests/test.sh"],
                                         timeout=timeout,
                                         dest=Path(tmp) / "verifier", cwd=workdir, env=env,
                                         agent_system=verifier.agent_system,
                                         user=shell.verifier_user)
        return decide(task.task_id, output=result.output, exit_code=result.exit_code,
                      timed_out=result.timed_out, timeout_s=timeout,
                      logs=got, network=task.config.environment.network,
                      tests=tests or task.tests_dir)


__all__ = ["NEEDS_NETWORK", "EpisodeContext", "Grade", "ImageMissing", "LeaseShell",
           "TaskImages", "grade", "grade_problem", "plan_errors", "rollout"]
