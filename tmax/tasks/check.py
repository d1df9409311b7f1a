"""Run a task's reference solution (or nothing) and its verifier in a throwaway sandbox.

``runtime="host"`` builds the environment on top of this machine's own system directories,
read-only, in a bubblewrap sandbox without network: a quick check for task authors before
any image exists. The task's writable directories (/app, /tmp, /opt, ...) are fresh folders;
Dockerfile WORKDIR/ENV/COPY/RUN and Apptainer %files/%environment/%post are applied there.
What it does not give you: the image's own packages (the host's are used) and writes
outside those directories. Task images (``tmax images``) lift both limits.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Literal, Protocol

from sandfleet.runtime.bwrap import BwrapSpec, host_root
from tmax.tasks.model import Problem, Task, TaskError
from tmax.tasks.native import dockerfile_instructions
from tmax.tasks.reward import VerifierError, read_reward

WRITABLE = ("/app", "/tmp", "/logs", "/tests", "/solution", "/root", "/home", "/opt", "/srv")
Mode = Literal["oracle", "nop"]


@dataclass
class CheckResult:
    task: str
    mode: str
    reward: float | None
    error: str = ""
    seconds: float = 0.0
    log: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


class HostSandbox:
    """A sandbox whose writable directories persist across commands; owns its temp dir."""

    def __init__(self, task: Task, workdir: Path):
        self.task, self.dir = task, workdir
        self.spec: BwrapSpec = host_root()
        for path in WRITABLE:
            host = workdir / path.lstrip("/")
            host.mkdir(parents=True, exist_ok=True)
            self.spec.binds.append((str(host), path))
        self.spec.cwd = "/"
        self.log: list[str] = []

    def host_path(self, path: str) -> Path:
        """Where sandbox ``path`` lives on the host; only inside the writable directories."""
        p = PurePosixPath(path)
        if not any(p == PurePosixPath(w) or PurePosixPath(w) in p.parents for w in WRITABLE):
            raise TaskError([Problem(self.task.task_id, "environment", f"writes to {path}",
                                     "the host check only supports "
                                     f"{', '.join(WRITABLE)}; build the task image instead")])
        return self.dir / str(p).lstrip("/")

    def run(self, command: str, timeout: float, cwd: str | None = None) -> int:
        argv = self.spec.argv(["sh", "-c", command])
        if cwd:
            argv[argv.index("--chdir") + 1] = cwd
        self.log.append(f"$ {command}")
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                  start_new_session=True, check=False)
        except subprocess.TimeoutExpired as e:
            self.log.append(f"[timed out after {timeout:g}s]")
            self.log.append((e.stdout or b"").decode(errors="replace")[-2000:]
                            if isinstance(e.stdout, bytes) else (e.stdout or "")[-2000:])
            return 124
        self.log.append((proc.stdout + proc.stderr)[-4000:].rstrip())
        self.log.append(f"[exit {proc.returncode}]")
        return proc.returncode

    def fetch(self, path: str, dest: Path) -> Path:
        return self.host_path(path)

    def copy_in(self, src: Path, dest: str) -> None:
        """Docker COPY semantics: a directory's contents go into dest; a file into dest/ if
        dest ends with '/' or is a directory."""
        target = self.host_path(dest)
        if src.is_dir():
            shutil.copytree(src, target, dirs_exist_ok=True, symlinks=True)
            return
        if dest.endswith("/") or target.is_dir():
            target = target / src.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def _apply_dockerfile(box: HostSandbox, task: Task) -> None:
    ctx = task.environment_dir
    workdir = "/"
    for line, word, args in dockerfile_instructions(task.definition.read_text()):
        if word == "WORKDIR":
            workdir = str(PurePosixPath(workdir) / args)
            box.host_path(workdir).mkdir(parents=True, exist_ok=True)
        elif word == "ENV":
            box.spec.env.update(_parse_env(args))
        elif word in ("COPY", "ADD"):
            parts = [p for p in shlex.split(args) if not p.startswith("--")]
            dest = parts[-1] if parts[-1].startswith("/") else f"{workdir}/{parts[-1]}"
            for src in parts[:-1]:
                for match in sorted(ctx.glob(src.lstrip("/"))):
                    box.copy_in(match, dest)
        elif word == "RUN":
            command = " ".join(json.loads(args)) if args.startswith("[") else args
            if box.run(command, task.config.environment.build_timeout_sec, workdir) != 0:
                raise RuntimeError(f"Dockerfile line {line}: RUN failed: {command[:80]}")
    box.spec.cwd = workdir


def _parse_env(args: str) -> dict[str, str]:
    parts = shlex.split(args)
    if parts and "=" not in parts[0]:  # legacy "ENV KEY value"
        return {parts[0]: " ".join(parts[1:])}
    return dict(p.split("=", 1) for p in parts)


def _apply_definition(box: HostSandbox, task: Task) -> None:
    from tmax.images.definition import parse_definition
    from tmax.images.rootfs import environment_of

    definition = parse_definition(task.definition.read_text())
    for src, dest in definition.files:
        box.copy_in(task.environment_dir / src, dest)
    box.spec.env.update(environment_of(definition))
    post = definition.sections.get("post", "")
    if post.strip() and box.run(post, task.config.environment.build_timeout_sec, "/") != 0:
        raise RuntimeError("%post failed")
    box.spec.cwd = "/root"


class CheckSandbox(Protocol):
    """What a check needs from a sandbox (the host sandbox here, image sandboxes elsewhere)."""

    def run(self, command: str, timeout: float, cwd: str | None = None) -> int: ...

    def copy_in(self, src: Path, dest: str) -> None: ...

    def fetch(self, path: str, dest: Path) -> Path:
        """Copy sandbox ``path`` (a directory) out to ``dest``; return the local copy."""


def run_solution(box: CheckSandbox, task: Task, cwd: str | None = None) -> int:
    """Copy solution/ to /solution and run solve.sh under the agent's time budget."""
    box.copy_in(task.solution_dir, "/solution")
    return box.run("bash /solution/solve.sh", task.config.agent.timeout_sec, cwd)


def run_verifier(box: CheckSandbox, task: Task, scratch: Path, cwd: str | None = None) -> float:
    """Remove stale rewards, copy tests/ to /tests, run test.sh, read the reward.

    Raises ``VerifierError`` when the verifier leaves no usable reward.
    """
    box.run("rm -rf /logs/verifier && mkdir -p /logs/verifier", 60, "/")
    box.copy_in(task.tests_dir, "/tests")
    box.run("bash /tests/test.sh", task.config.verifier.timeout_sec, cwd)
    return read_reward(box.fetch("/logs/verifier", scratch / "verifier"), task.task_id)


def check_task(task: Task, mode: Mode = "oracle") -> CheckResult:
    """Build the task's environment on the host, run ``mode``, then the verifier."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"tmax-check-{task.task_id}-") as tmp:
        box = HostSandbox(task, Path(tmp) / "box")
        try:
            if task.definition_kind == "dockerfile":
                _apply_dockerfile(box, task)
            else:
                _apply_definition(box, task)
            box.spec.env.update(task.config.verifier.env | task.config.solution.env)
            if mode == "oracle":
                run_solution(box, task)
            reward, error = run_verifier(box, task, Path(tmp)), ""
        except (VerifierError, TaskError, RuntimeError, OSError) as e:
            reward, error = None, str(e)
        return CheckResult(task.task_id, mode, reward, error,
                           round(time.monotonic() - start, 2), "\n".join(box.log))
