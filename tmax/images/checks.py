"""Build-time checks of a task image, run in real sandboxes of the image.

1. the image starts (a sandbox comes up and runs a command);
2. the verifier on the untouched environment gives less than full reward;
3. the reference solution gets full reward (not checked, with a note, for a task without
   one: solution/ is optional in Harbor).

Each check runs in a fresh sandbox with the task's own limits. The result, with the reason
of a failure, goes into the image's manifest entry; the log next to the build log.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

from sandfleet import InfraError, Runtime, SandboxSpec
from tmax.images.rootfs import DEFAULT_PATH
from tmax.images.store import Checks
from tmax.tasks import Task
from tmax.tasks.check import run_solution
from tmax.tasks.model import SOLVE_SCRIPT
from tmax.tasks.reward import VerifierError, read_reward


class RuntimeBox:
    """A ``CheckSandbox`` over one sandbox of a runtime; logs what it runs."""

    def __init__(self, runtime: Runtime, sandbox_id: str, workdir: str, log: list[str]):
        self.runtime, self.id, self.workdir, self.log = runtime, sandbox_id, workdir, log
        self.base_path = DEFAULT_PATH
        """The PATH the sandbox starts with (the image's ENV PATH): the verifier's, as in
        rollouts (``tmax.rollout.run.grade``)."""

    def probe_path(self) -> None:
        """Read the sandbox's PATH before anything runs in it."""
        result = self.runtime.exec(self.id, 'printf %s "$PATH"', timeout=30, cwd="/")
        self.base_path = result.output.strip() or DEFAULT_PATH

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

    def verify(self, task: Task, scratch: Path) -> float:
        """test.sh through the runtime's ``verify``, as rollouts run it: /tests and
        /logs/verifier of its own, the image's system tools (unless the task opts out)."""
        logs = scratch / "verifier"
        verifier = task.config.verifier
        result = self.runtime.verify(self.id, ["/bin/bash", "/tests/test.sh"],
                                     tests=task.tests_dir, logs=logs,
                                     timeout=verifier.timeout_sec, cwd=self.workdir,
                                     env={"PATH": self.base_path, **verifier.env},
                                     agent_system=verifier.agent_system)
        status = (f"[exit {result.exit_code}{', timed out' if result.timed_out else ''}, "
                  f"{result.duration_s:.1f}s]")
        self.log += ["$ verify: /bin/bash /tests/test.sh", result.output.rstrip(), status]
        try:
            return read_reward(logs, task.task_id)
        except VerifierError as e:
            if result.timed_out:  # the cause, not only its consequence
                raise VerifierError(task.task_id, f"timed out after {verifier.timeout_sec:g} s "
                                    f"([verifier] timeout_sec) and {e.reason}") from None
            raise


def task_spec(task: Task, sif: Path, workdir: str) -> SandboxSpec:
    env = task.config.environment
    budget = task.config.agent.timeout_sec + task.config.verifier.timeout_sec + 300
    return SandboxSpec(image=sif, cpus=env.cpus, memory_mb=env.memory_mb,
                       storage_mb=env.storage_mb, network=env.network, max_lifetime_s=budget,
                       workdir=workdir)


def run_mode(runtime: Runtime, task: Task, sif: Path, workdir: str, mode: str,
             log: list[str]) -> float:
    """One fresh sandbox: optionally the solution, then the verifier; the reward."""
    sandbox_id = f"check-{uuid.uuid4().hex[:12]}"
    log.append(f"## {mode} in sandbox {sandbox_id}")
    runtime.start(sandbox_id, task_spec(task, sif, workdir))
    try:
        box = RuntimeBox(runtime, sandbox_id, workdir, log)
        box.probe_path()
        if mode == "oracle":
            run_solution(box, task)
        with tempfile.TemporaryDirectory(prefix="tmax-check-") as scratch:
            return box.verify(task, Path(scratch))
    finally:
        runtime.stop(sandbox_id)


def check_image(runtime: Runtime, runtime_name: str, task: Task, sif: Path, workdir: str,
                log_path: Path) -> Checks:
    log: list[str] = []
    rewards: dict[str, float | None] = {"nop": None, "oracle": None}
    starts, reason, note = True, "", ""
    modes: tuple[str, ...] = ("nop", "oracle")
    if not task.has_solution:
        modes, note = ("nop",), f"no reference solution ({SOLVE_SCRIPT}): oracle not checked"
        log.append(f"## oracle: {note}")
    try:
        for mode in modes:
            rewards[mode] = run_mode(runtime, task, sif, workdir, mode, log)
    except InfraError as e:
        starts = rewards["nop"] is not None
        reason = f"{'sandbox failed' if starts else 'image does not start'}: {e}"
    except VerifierError as e:
        reason = f"verifier: {e.reason}"
    if not reason:
        if (rewards["nop"] or 0.0) >= 1.0:
            reason = f"the untouched environment already scores {rewards['nop']}"
        elif "oracle" in modes and rewards["oracle"] != 1.0:
            reason = f"the reference solution scores {rewards['oracle']}, not 1"
            if unmet := unmet_needs(sif):
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
    import subprocess

    from sandfleet import sif as sif_file

    try:
        offset = sif_file.read_partition(sif).offset
        out = subprocess.run(["unsquashfs", "-o", str(offset), "-cat", str(sif),
                              ".tmax/verifier/unmet"], capture_output=True, text=True,
                             timeout=60, check=False)
    except (OSError, sif_file.SifError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] \
        if out.returncode == 0 else []


def image_checker(cache_dir: Path, runtime: str = "auto"
                  ) -> Callable[[Task, Path, str, Path], Checks]:
    """A checker for ``ImageBuilds``: apptainer where it is on PATH, else the local runtime
    (which mounts each image in place: nothing per image is left on the node)."""
    from sandfleet import get_runtime

    if runtime == "auto":
        runtime = "apptainer" if shutil.which("apptainer") else "local"
    state = Path(cache_dir) / "check-sandboxes"
    if runtime != "local":
        rt = get_runtime(runtime, state_dir=state)
        return lambda task, sif, workdir, log_path: check_image(rt, runtime, task, sif,
                                                                  workdir, log_path)

    shutil.rmtree(Path(cache_dir) / "check-roots", ignore_errors=True)  # older versions' unpacks
    rt = get_runtime("local", state_dir=state)
    return lambda task, sif, workdir, log_path: check_image(rt, "local", task, sif, workdir,
                                                              log_path)
