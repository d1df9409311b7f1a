"""Build-time checks of a task image, run in real sandboxes of the image.

1. the image starts (a sandbox comes up and runs a command);
2. the verifier on the untouched environment gives less than full reward;
3. the reference solution gets full reward (not checked, with a note, for a task without
   one: solution/ is optional in Harbor).

A task with a separate verifier (Harbor's ``environment_mode = "separate"``) is graded as
in rollouts: its artifacts are copied out of the sandbox, which then stops, into a fresh
sandbox of the verifier's image (or of the task's own, when tests/ has no Dockerfile), where
test.sh runs.

Each check runs in a fresh sandbox with the task's own limits. Its verifier's run is graded
by ``tmax.tasks.grading.decide``, the one decision rollouts, evaluation and the audit use:
a reward the tests wrote stands, a verifier that wrote none (or whose test runner never
started) is a verifier error, and one that runs past its timeout scores 0: the nop check
passes on it, the oracle check fails.
The result, with the reason of a failure, goes into the image's manifest entry; the log
next to the build log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from sandfleet import InfraError, Runtime, SandboxSpec, get_runtime, layers, netproxy
from sandfleet import sif as sif_file
from tmax.images.store import Checks
from tmax.images.types import DEFAULT_PATH
from tmax.tasks import Task, artifacts
from tmax.tasks.check import MissingSolution, run_solution
from tmax.tasks.environment import PROBE as ENV_PROBE
from tmax.tasks.environment import parse_probe, verifier_env
from tmax.tasks.grading import Grade, decide
from tmax.tasks.model import NO_BAKED_TESTS, SOLVE_SCRIPT
from tmax.tasks.reward import VerifierError
from tmax.tasks.steps import TaskStep, healthcheck_command, merged_tests, multi_step_reward

CONTRADICTED_LOG = "contradicted reward"
"""How the log begins the line of a reward of 1 its test report contradicted (scored 0)."""
TIMED_OUT = "verifier timed out"
"""How the log begins the line of a verifier that ran past its timeout (and scored 0)."""


@dataclass(frozen=True)
class SandboxImage:
    """An image to check in: its SIF, where commands start, and what a sandbox of it runs
    first (its ENTRYPOINT as Harbor starts it: ``TaskDefinition.start_command``)."""

    sif: Path
    workdir: str
    start: str = ""
    user: str = ""
    """Who its commands run as (``Plan.user``); "" for root."""
    verifier_user: str = ""
    """Who tests/test.sh runs as in a sandbox of it (``Plan.verifier_user``); "" for root."""


class RuntimeBox:
    """A ``CheckSandbox`` over one sandbox of a runtime; logs what it runs."""

    def __init__(self, runtime: Runtime, sandbox_id: str, workdir: str, log: list[str],
                 verifier_user: str = ""):
        self.runtime, self.id, self.workdir, self.log = runtime, sandbox_id, workdir, log
        self.verifier_user = verifier_user
        """Who test.sh runs as ("" for root); artifacts are collected as root."""
        self.env: dict[str, str] = {}
        """The image's environment, which the verifier gets (as Docker's exec would)."""
        self.base_path = DEFAULT_PATH
        """The PATH the sandbox starts with (the image's ENV PATH): the verifier's, as in
        rollouts (``tmax.rollout.run.grade``)."""

    def probe_path(self) -> None:
        """Read the sandbox's environment (its PATH too) before anything runs in it."""
        result = self.runtime.exec(self.id, ENV_PROBE, timeout=30, cwd="/")
        self.env = parse_probe(result.output)
        self.base_path = self.env.get("PATH") or DEFAULT_PATH

    def begin(self, start: str) -> None:
        """The PATH, then the image's start command (its ENTRYPOINT), if it has one."""
        self.probe_path()
        if start:
            self.run(start, 60, cwd="/")

    def run(self, command: str, timeout: float, cwd: str | None = None) -> int:
        result = self.runtime.exec(self.id, command, timeout=timeout, cwd=cwd or self.workdir)
        status = (f"[exit {result.exit_code}{', timed out' if result.timed_out else ''}"
                  f"{', oom' if result.oom else ''}, {result.duration_s:.1f}s]")
        self.log += [f"$ {command}", result.output.rstrip(), status]
        return result.exit_code

    def copy_in(self, src: Path, dest: str) -> None:
        self.runtime.copy_in(self.id, src, dest)

    def fetch(self, path: str, dest: Path) -> Path:
        self.runtime.copy_out(self.id, path, dest)
        return dest

    def collect_artifacts(self, task: Task, dest: Path) -> list[tuple[Path, str]]:
        """The task's artifacts that exist, copied out as rollouts copy them
        (``tmax.tasks.artifacts``: archived as a verifier runs, unpacked as data)."""
        self.runtime.verify(self.id, artifacts.command(task.artifacts),
                            tests=artifacts.collector(dest / "collector"),
                            logs=dest / "collected", timeout=artifacts.TIMEOUT_S, cwd="/",
                            env={"PATH": DEFAULT_PATH})
        return artifacts.unpack(dest / "collected", task.artifacts, dest / "unpacked")

    def verify(self, task: Task, scratch: Path, tests: Path | None = None,
               step: TaskStep | None = None) -> Grade:
        """test.sh through the runtime's ``verify``, as rollouts run it: /tests
        (``tests``, else the task's tests/) and /logs/verifier of its own, the image's
        system tools (unless the task opts out); a ``step``'s timeout and env. Graded by
        ``tmax.tasks.grading.decide``, as rollouts grade; ``VerifierError`` when that
        gives no reward."""
        logs = scratch / "verifier"
        verifier = task.config.verifier
        timeout = step.verifier_timeout_sec if step else verifier.timeout_sec
        result = self.runtime.verify(self.id, ["/bin/bash", "/tests/test.sh"],
                                     tests=tests or task.tests_dir, logs=logs,
                                     timeout=timeout, cwd=self.workdir,
                                     env=verifier_env(self.env, self.base_path,
                                                      step.verifier_env if step
                                                      else verifier.env),
                                     agent_system=verifier.agent_system,
                                     user=self.verifier_user)
        status = (f"[exit {result.exit_code}{', timed out' if result.timed_out else ''}, "
                  f"{result.duration_s:.1f}s]")
        who = f" (as {self.verifier_user})" if self.verifier_user else ""
        self.log += [f"$ verify{who}: /bin/bash /tests/test.sh", result.output.rstrip(),
                     status]
        g = decide(task.task_id, output=result.output, exit_code=result.exit_code,
                   timed_out=result.timed_out, timeout_s=timeout, logs=logs,
                   network=task.config.environment.network, tests=tests or task.tests_dir)
        if g.timed_out:  # scores 0, as in rollouts
            self.log.append(f"{TIMED_OUT} after {timeout:g} s ([verifier] timeout_sec): "
                            "scores 0")
        if g.note:
            self.log.append(f"grading note: {g.note}")
        if g.contradicted:
            self.log.append(f"{CONTRADICTED_LOG}: the reward of 1 its test report "
                            f"contradicts scores 0: {g.contradicted}")
        if g.reward is None:
            raise VerifierError(task.task_id, g.error)
        return g

    def begin_step(self, step: TaskStep) -> str:
        """Before a step's agent: its workdir/ into the working directory, its setup.sh
        run there, its healthcheck passed. What went wrong, or "" (as rollouts)."""
        if step.workdir_dir.is_dir():
            self.copy_in(step.workdir_dir, self.workdir)
            if (step.workdir_dir / "setup.sh").is_file() and \
                    (code := self.run("bash ./setup.sh", step.agent_timeout_sec)) != 0:
                return f"setup.sh failed (exit {code})"
        if step.healthcheck is None:
            return ""
        command, attempts, interval, timeout = healthcheck_command(step.healthcheck)
        for attempt in range(attempts):
            if self.run(command, timeout) == 0:
                return ""
            if attempt + 1 < attempts:
                time.sleep(interval)
        return f"the healthcheck ({command}) failed {attempts} times"


def task_spec(task: Task, sif: Path, workdir: str, *, verifier: bool = False,
              user: str = "") -> SandboxSpec:
    """A sandbox of ``sif`` with the task's limits (``verifier``: its separate verifier's),
    its commands run as ``user``."""
    env = task.config.verifier_resources if verifier else task.config.environment
    budget = task.config.agent.timeout_sec + task.config.verifier.timeout_sec + 300
    # the solution runs as the agent would (a Harbor task that says nothing: the registries)
    network, hosts = (env.network, ()) if verifier else task.config.agent_network("registries")
    return SandboxSpec(image=sif, cpus=env.cpus, memory_mb=env.memory_mb,
                       storage_mb=env.storage_mb, network=network, max_lifetime_s=budget,
                       workdir=workdir, user=user, allowed_hosts=hosts)


def run_steps(box: RuntimeBox, task: Task, mode: str, scratch: Path) -> float:
    """A multi-step task in one sandbox: each step's workdir, setup and healthcheck, its
    solution (the oracle), its verifier over the merged tests; the steps after one below
    its ``min_reward`` (or whose healthcheck fails) do not run. The task's reward."""
    rewards: list[float] = []
    for step in task.steps:
        box.log.append(f"## step {step.name}")
        if problem := box.begin_step(step):
            if step.index == 0:  # before anything ran: the task's, as in rollouts
                raise VerifierError(task.task_id, f"step {step.name}: {problem}")
            box.log.append(f"step {step.name}: {problem}; no more steps")
            break
        if mode == "oracle":
            if not step.solve_script.is_file():
                raise MissingSolution(task.task_id)
            box.copy_in(step.solve_script.parent, "/solution")
            box.run("bash /solution/solve.sh", step.agent_timeout_sec)
        here = scratch / f"step-{step.index}"
        g = box.verify(task, here, merged_tests(task, step, here / "tests"), step)
        reward = g.reward or 0.0
        rewards.append(reward)
        if not step.passes(reward, g.metrics):
            box.log.append(f"step {step.name}: {reward} is below min_reward; no more steps")
            break
    return multi_step_reward(rewards, len(task.steps), task.config.multi_step_reward_strategy)


log_ = logging.getLogger(__name__)
_LIVE: dict[str, Runtime] = {}
"""The check sandboxes this process has running (id -> the runtime that started it)."""
_LIVE_LOCK = threading.Lock()
STOP_ON_SIGTERM_S = 20.0
"""How long a SIGTERM waits for the check sandboxes to stop (Slurm's KillWait is 30 s)."""


def stop_live_checks() -> list[str]:
    """Stop every check sandbox this process has running; their ids."""
    with _LIVE_LOCK:
        live = dict(_LIVE)
    for sandbox_id, runtime in live.items():
        try:
            runtime.stop(sandbox_id)
        except Exception as e:  # noqa: BLE001 - the others are still stopped
            log_.warning("check sandbox %s not stopped: %s", sandbox_id, e)
    return sorted(live)


@contextlib.contextmanager
def checks_end_on_sigterm() -> Iterator[None]:
    """While the body runs, a SIGTERM (Slurm's scancel, a job past its time, kill) first
    stops the check sandboxes this process has running, then ends it as SIGTERM does.
    The sandboxes are not this process's children (each has its own process group and
    cgroups): without this they ran on until their lifetime. In the main thread only
    (elsewhere it does nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop() -> None:
        if stopped := stop_live_checks():
            log_.warning("SIGTERM: stopped check sandboxes %s", ", ".join(stopped))

    def handler(signum, frame) -> None:
        # in a thread of its own, bounded: the main thread may hold a lock that stopping
        # needs (the runtime's, in the middle of a start) until this handler returns
        stopper = threading.Thread(target=stop, name="checks-sigterm", daemon=True)
        stopper.start()
        stopper.join(timeout=STOP_ON_SIGTERM_S)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def fresh_box(runtime: Runtime, task: Task, image: SandboxImage, log: list[str],
              what: str, *, verifier: bool = False) -> Iterator[RuntimeBox]:
    """A fresh sandbox of ``image`` with the task's limits (``verifier``: its separate
    verifier's), its environment read and its ENTRYPOINT started; stopped at the end."""
    sandbox_id = f"check-{uuid.uuid4().hex[:12]}"
    runtime = netproxy.ProxiedRuntime(runtime)  # an allowlist's proxy, closed while test.sh runs
    log.append(f"## {what} in sandbox {sandbox_id}")
    with _LIVE_LOCK:  # (before the start: a SIGTERM during it still stops it)
        _LIVE[sandbox_id] = runtime
    try:
        runtime.start(sandbox_id, task_spec(task, image.sif, image.workdir,
                                            verifier=verifier, user=image.user))
        try:
            box = RuntimeBox(runtime, sandbox_id, image.workdir, log, image.verifier_user)
            box.begin(image.start)
            yield box
        finally:
            runtime.stop(sandbox_id)
    finally:
        with _LIVE_LOCK:
            _LIVE.pop(sandbox_id, None)


def run_mode(runtime: Runtime, task: Task, image: SandboxImage, mode: str, log: list[str],
             verifier: SandboxImage | None = None) -> float:
    """One fresh sandbox: optionally the solution, then the verifier (in a sandbox of
    ``verifier``, or of this image, for a separate verifier); the reward."""
    with tempfile.TemporaryDirectory(prefix="tmax-check-") as tmp:
        scratch = Path(tmp)
        with fresh_box(runtime, task, image, log, mode) as box:
            if task.steps:
                return run_steps(box, task, mode, scratch)
            if mode == "oracle":
                run_solution(box, task)
            if not task.separate_verifier:
                return box.verify(task, scratch).reward or 0.0
            handed = box.collect_artifacts(task, scratch / "artifacts")
            log.append(f"artifacts for the verifier: {[p for _, p in handed] or 'none'}")
        # the agent's sandbox is gone: the verifier gets the artifacts, nothing else
        return verify_separately(runtime, task, verifier or image, handed, scratch, log)


def verify_separately(runtime: Runtime, task: Task, image: SandboxImage,
                      artifacts: list[tuple[Path, str]], scratch: Path, log: list[str]
                      ) -> float:
    """test.sh in a fresh sandbox of ``image`` holding ``artifacts`` (host copy, path) at
    their paths; /tests as the verifier's image has it when tests/ built that image."""
    with fresh_box(runtime, task, image, log, "separate verifier", verifier=True) as box:
        tests = None
        if task.verifier_definition is not None:
            try:
                tests = box.fetch("/tests", scratch / "tests")
            except FileNotFoundError:
                raise VerifierError(task.task_id, NO_BAKED_TESTS) from None
        for local, path in artifacts:
            box.copy_in(local, path)
        return box.verify(task, scratch, tests).reward or 0.0


def check_image(runtime: Runtime, runtime_name: str, task: Task, image: SandboxImage,
                log_path: Path, verifier: SandboxImage | None = None) -> Checks:
    """The checks of ``task``'s ``image`` (``verifier``: its separate verifier's image,
    when it has one)."""
    log: list[str] = []
    rewards: dict[str, float | None] = {"nop": None, "oracle": None}
    starts, reason, note = True, "", ""
    modes: tuple[str, ...] = ("nop", "oracle")
    if not (all(s.solve_script.is_file() for s in task.steps) if task.steps
            else task.has_solution):
        modes, note = ("nop",), f"no reference solution ({SOLVE_SCRIPT}): oracle not checked"
        log.append(f"## oracle: {note}")
    errors: list[str] = []
    timed_out: dict[str, str] = {}
    contradicted: dict[str, str] = {}
    try:
        for mode in modes:  # each runs, so that both rewards are known where they can be
            start = len(log)
            try:
                rewards[mode] = run_mode(runtime, task, image, mode, log, verifier)
            except VerifierError as e:  # the sandbox came up: the verifier's problem
                errors.append(e.reason)
            if said := [line for line in log[start:] if line.startswith(TIMED_OUT)]:
                timed_out[mode] = said[-1].split(":")[0]
            if said := [line for line in log[start:] if line.startswith(CONTRADICTED_LOG)]:
                contradicted[mode] = said[-1].split("scores 0: ", 1)[-1]
    except InfraError as e:
        starts = rewards["nop"] is not None or bool(errors)
        reason = f"{'sandbox failed' if starts else 'image does not start'}: {e}"
    if errors and not reason:
        reason = f"verifier: {errors[0]}"
    if not reason:
        if (rewards["nop"] or 0.0) >= 1.0:
            reason = f"the untouched environment already scores {rewards['nop']}"
        elif "oracle" in modes and rewards["oracle"] != 1.0:
            reason = f"the reference solution scores {rewards['oracle']}, not 1"
            if "oracle" in timed_out:
                reason += f" (its {timed_out['oracle']})"
            if "oracle" in contradicted:
                reason += f" (its test report contradicts its 1: {contradicted['oracle']})"
            if unmet := unmet_needs((verifier or image).sif):
                reason += f" (the verifier's tools could not be prepared offline: " \
                          f"{'; '.join(unmet)})"
    log.append(f"## result: {reason or 'ok'}")
    log_path.write_text("\n".join(log) + "\n")
    return Checks(runtime=runtime_name, starts=starts, nop_reward=rewards["nop"],
                  oracle_reward=rewards["oracle"], ok=not reason, reason=reason, note=note)


def unmet_needs(sif: Path) -> list[str]:
    """What the image's verifier tools could not prepare (/.tmax/verifier/unmet, written
    by the build: tmax.images.verifier_tools), read from the SIF's file system; [] when
    there is nothing, or nothing can be read."""
    try:
        text = layers.cat(sif, ".tmax/verifier/unmet", timeout=60)
    except (OSError, sif_file.SifError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in (text or "").splitlines() if line.strip()]


def image_checker(cache_dir: Path, runtime: str = "auto"
                  ) -> Callable[[Task, SandboxImage, Path, SandboxImage | None], Checks]:
    """A checker for ``ImageBuilds``: the local runtime as root (sealed; it mounts each image
    in place: nothing per image is left on the node), else apptainer where it is on PATH
    (as root, Apptainer's sandbox root would be host root: refused by that runtime)."""
    if runtime == "auto":
        runtime = "apptainer" if shutil.which("apptainer") and os.geteuid() else "local"
    state = Path(cache_dir) / "check-sandboxes"
    if runtime == "local":  # older versions' unpacks
        shutil.rmtree(Path(cache_dir) / "check-roots", ignore_errors=True)
    rt, name = get_runtime(runtime, state_dir=state), runtime

    def checker(task: Task, image: SandboxImage, log_path: Path,
                verifier: SandboxImage | None = None) -> Checks:
        return check_image(rt, name, task, image, log_path, verifier)

    return checker
