"""Run a task's reference solution (or nothing) and its verifier in a throwaway sandbox.

``runtime="host"`` builds the environment on top of this machine's own system directories,
read-only, in a bubblewrap sandbox without network: a quick check for task authors before
any image exists. The task's writable directories (/app, /tmp, /opt, ...) are fresh folders;
Dockerfile WORKDIR/ENV/COPY/RUN and Apptainer %files/%environment/%post are applied there.
What it does not give you: the image's own packages (the host's are used) and writes
outside those directories. Task images (``tmax images``) lift both limits.

The task is untrusted. Before anything is copied, its folder is validated again (it may
have changed since it was loaded): symlinks and COPY sources that leave it are refused
(``tmax.tasks.confine``). What it runs is root only inside its own user namespace, whose
uid 0 is ``SANDBOX_UID`` on the host when the check runs as root (else the user running
it), with no capabilities: it reads only what any user may read of the host's system
directories, and writes only its own folders. Files go in by a copy made inside the
sandbox, and the host reads nothing back through a link the sandbox made.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Literal, Protocol

from sandfleet import BwrapSpec, host_root
from tmax.tasks.confine import expand_source
from tmax.tasks.container_def import parse_definition
from tmax.tasks.dockerfile import Copy, Run, Workdir
from tmax.tasks.dockerfile import parse as parse_dockerfile
from tmax.tasks.environment import PROBE, parse_probe
from tmax.tasks.grading import decide
from tmax.tasks.model import MissingSolution, Problem, Task, TaskError
from tmax.tasks.native import validate_task
from tmax.tasks.reward import VerifierError

WRITABLE = ("/app", "/tmp", "/logs", "/tests", "/solution", "/root", "/home", "/opt", "/srv")
Mode = Literal["oracle", "nop"]

SANDBOX_UID = 65534
"""Host uid (and gid) of the sandbox's root when the check runs as root: "nobody", meant to
own no files (the host folders the sandbox sees are read-only to it anyway)."""
USERNS = ["--unshare-user", "--uid", "0", "--gid", "0", "--cap-drop", "ALL"]
STAGE = "/.tmax-stage"
"""Where a file being copied in is bound, read-only, for the copy made inside."""
# $1: destination in the sandbox, $2: the staged file's name
_COPY_DIR = f'mkdir -p -- "$1" && cp -R --preserve=mode,timestamps -- {STAGE}/"$2"/. "$1"'
_COPY_FILE = ('case $1 in */) mkdir -p -- "$1" ;; '
              '*) [ -d "$1" ] || mkdir -p -- "$(dirname -- "$1")" ;; esac && '
              f'cp --preserve=mode,timestamps -- {STAGE}/"$2" "$1"')


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


def _as_sandbox_user() -> dict:
    """subprocess keywords that drop to ``SANDBOX_UID`` when we are root (none otherwise)."""
    if os.geteuid() != 0:
        return {}
    return {"user": SANDBOX_UID, "group": SANDBOX_UID, "extra_groups": []}


@functools.cache
def _userns_refusal() -> str:
    """Why bubblewrap cannot give this machine's users a user namespace ('' when it can)."""
    spec = host_root()
    spec.extra_args += USERNS
    try:
        proc = subprocess.run(spec.argv(["true"]), capture_output=True, text=True, timeout=30,
                              check=False, **_as_sandbox_user())
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return "" if proc.returncode == 0 else proc.stderr.strip() or f"exit {proc.returncode}"


class HostSandbox:
    """A sandbox whose writable directories persist across commands, kept under ``workdir``
    (a fresh folder the sandbox owns; the sandbox's user gets it)."""

    def __init__(self, task: Task, workdir: Path):
        if refusal := _userns_refusal():
            raise RuntimeError("the host check runs as root of an unprivileged user namespace,"
                               f" and bubblewrap could not make one: {refusal} (enable "
                               "unprivileged user namespaces, or build the task image)")
        self.task, self.dir = task, workdir
        self.as_user = _as_sandbox_user()
        self.spec: BwrapSpec = host_root()
        self.spec.extra_args += USERNS
        for path in WRITABLE:
            host = workdir / path.lstrip("/")
            host.mkdir(parents=True, exist_ok=True)
            self.spec.binds.append((str(host), path))
        self._give(workdir)
        self.spec.cwd = "/"
        self.log: list[str] = []
        self.last: tuple[str, int, bool] = ("", 0, False)
        """The last command's output, exit status and whether it timed out."""

    def _give(self, path: Path) -> None:
        """Hand ``path`` (a tree only the host wrote) to the sandbox's user."""
        if not self.as_user:
            return
        for folder, dirs, files in os.walk(path):
            os.chown(folder, SANDBOX_UID, SANDBOX_UID, follow_symlinks=False)
            for name in dirs + files:
                os.chown(os.path.join(folder, name), SANDBOX_UID, SANDBOX_UID,
                         follow_symlinks=False)

    def host_path(self, path: str) -> Path:
        """Where sandbox ``path`` lives on the host; only inside the writable directories."""
        p = PurePosixPath(os.path.normpath(path))
        if not any(p == PurePosixPath(w) or PurePosixPath(w) in p.parents for w in WRITABLE):
            raise TaskError([Problem(self.task.task_id, "environment", f"writes to {path}",
                                     "the host check only supports "
                                     f"{', '.join(WRITABLE)}; build the task image instead")])
        return self.dir / str(p).lstrip("/")

    def run(self, command: str, timeout: float, cwd: str | None = None) -> int:
        return self._exec(["sh", "-c", command], timeout, cwd, label=command)

    def _exec(self, command: list[str], timeout: float, cwd: str | None = None, *,
              label: str, quiet: bool = False, ro_binds: tuple[tuple[str, str], ...] = ()
              ) -> int:
        """Run ``command`` in the sandbox as its root; log it (``quiet``: only a failure)."""
        spec = replace(self.spec, ro_binds=[*self.spec.ro_binds, *ro_binds],
                       cwd=cwd or self.spec.cwd)
        self.log.append(f"$ {label}")
        try:
            proc = subprocess.run(spec.argv(command), capture_output=True, text=True,
                                  timeout=timeout, start_new_session=True, check=False,
                                  **self.as_user)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode(errors="replace") \
                if isinstance(e.stdout, bytes) else (e.stdout or "")
            self.log.append(f"[timed out after {timeout:g}s]")
            self.log.append(out[-2000:])
            self.last = (out, 124, True)
            return 124
        self.last = (proc.stdout + proc.stderr, proc.returncode, False)
        if not quiet or proc.returncode:
            self.log.append((proc.stdout + proc.stderr)[-4000:].rstrip())
            self.log.append(f"[exit {proc.returncode}]")
        return proc.returncode

    def environment(self, script: str) -> dict[str, str]:
        """The variables a %environment ``script`` exports, evaluated in the sandbox (a
        task's text never runs on the host itself)."""
        spec = replace(self.spec, env={"PATH": self.spec.env.get(
            "PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")})
        try:
            proc = subprocess.run(spec.argv(["sh", "-c", f"{script}\n{PROBE}"]),
                                  capture_output=True, text=True, timeout=60,
                                  start_new_session=True, check=False, **self.as_user)
        except subprocess.TimeoutExpired:
            raise RuntimeError("%environment did not finish in 60 s") from None
        return parse_probe(proc.stdout) if proc.returncode == 0 else {}

    def mkdir(self, path: str) -> None:
        """``mkdir -p`` inside, where links resolve as the sandbox sees them."""
        self.host_path(path)
        if self._exec(["mkdir", "-p", "--", path], 60, "/", label=f"mkdir -p {path}",
                      quiet=True) != 0:
            raise RuntimeError(f"could not make {path} in the sandbox (see the log)")

    def fetch(self, path: str, dest: Path) -> Path:
        """Sandbox ``path`` on the host (not copied); refused when it or a folder above it is
        a link made in the sandbox (the host would follow it out)."""
        host = self.host_path(path)
        for p in (host, *host.parents):
            if p == self.dir:
                break
            if p.is_symlink():
                raise VerifierError(self.task.task_id, f"{path} is a symlink, not a directory "
                                    "(the check reads rewards only from the sandbox's own "
                                    "folders)")
        return host

    def copy_in(self, src: Path, dest: str) -> None:
        """Docker COPY semantics: a directory's contents go into dest; a file into dest/ if
        dest ends with '/' or is a directory. Staged on the host, then copied inside the
        sandbox by its own user: what the sandbox made (links included) is never followed by
        the host, and the copies belong to the sandbox's root."""
        self.host_path(dest)
        stage = Path(tempfile.mkdtemp(prefix=".stage-", dir=self.dir))
        try:
            if src.is_dir():
                shutil.copytree(src, stage / "dir", symlinks=True)
                argv = ["sh", "-c", _COPY_DIR, "sh", dest, "dir"]
            else:
                shutil.copy2(src, stage / src.name)
                argv = ["sh", "-c", _COPY_FILE, "sh", dest, src.name]
            self._give(stage)
            rc = self._exec(argv, self.task.config.environment.build_timeout_sec, "/",
                            label=f"copy {src.name} -> {dest}", quiet=True,
                            ro_binds=((str(stage), STAGE),))
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        if rc != 0:
            raise RuntimeError(f"copying {src.name} to {dest} failed (see the log)")


def _apply_dockerfile(box: HostSandbox, task: Task) -> None:
    """The final stage's steps, in order (tmax.tasks.dockerfile); COPY --from and ADD of
    URLs are skipped (the host check has no other stages, nor the network)."""
    ctx = task.environment_dir
    stage = parse_dockerfile(task.definition.read_text()).final
    base_env = dict(box.spec.env)
    for step in stage.steps:
        if isinstance(step, Workdir):
            box.mkdir(step.path)
        elif isinstance(step, Copy) and step.from_stage is None and not step.from_image:
            for src in step.sources:
                for match in [] if "://" in src else expand_source(ctx, src):
                    box.copy_in(match, step.dest)
        elif isinstance(step, Run):
            command = step.argv[-1] if step.argv[:-1] in (("/bin/sh", "-c"), ("sh", "-c")) \
                else shlex.join(step.argv)
            box.spec.env = {**base_env, **dict(step.env)}
            if box.run(command, task.config.environment.build_timeout_sec, step.workdir) != 0:
                raise RuntimeError(f"Dockerfile line {step.line}: RUN failed: "
                                   f"{step.text[:80]}")
    box.spec.env = {**base_env, **stage.env}
    box.spec.cwd = stage.workdir


def _apply_definition(box: HostSandbox, task: Task) -> None:
    definition = parse_definition(task.definition.read_text())
    for src, dest in definition.files:
        for match in expand_source(task.environment_dir, src):
            box.copy_in(match, dest)
    box.spec.env.update(box.environment(definition.sections.get("environment", "")))
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
    """Copy solution/ to /solution and run solve.sh under the agent's time budget.

    Raises ``MissingSolution`` for a task without solution/solve.sh."""
    if not task.has_solution:
        raise MissingSolution(task.task_id)
    box.copy_in(task.solution_dir, "/solution")
    return box.run("bash /solution/solve.sh", task.config.agent.timeout_sec, cwd)


def run_verifier(box: CheckSandbox, task: Task, scratch: Path, cwd: str | None = None) -> float:
    """Remove stale rewards, copy tests/ to /tests, run test.sh, read the reward.

    Graded by ``tmax.tasks.grading.decide``, as image checks and rollouts grade; raises
    ``VerifierError`` when that gives no reward.
    """
    box.run("rm -rf /logs/verifier && mkdir -p /logs/verifier", 60, "/")
    box.copy_in(task.tests_dir, "/tests")
    timeout = task.config.verifier.timeout_sec
    box.run("bash /tests/test.sh", timeout, cwd)
    output, code, timed_out = getattr(box, "last", ("", 0, False))
    g = decide(task.task_id, output=output, exit_code=code, timed_out=timed_out,
               timeout_s=timeout, logs=box.fetch("/logs/verifier", scratch / "verifier"),
               network=task.config.environment.network, tests=task.tests_dir)
    if g.reward is None:
        raise VerifierError(task.task_id, g.error)
    return g.reward


def check_task(task: Task, mode: Mode = "oracle") -> CheckResult:
    """Build the task's environment on the host, run ``mode``, then the verifier.

    The task's folder is validated again first; with any error, nothing is copied or run.
    """
    start = time.monotonic()
    refused = [p for p in validate_task(task.root, task_id=task.task_id)
               if p.severity == "error"]
    if refused:
        return CheckResult(task.task_id, mode, None, str(TaskError(refused)),
                           round(time.monotonic() - start, 2))
    if task.steps or task.separate_verifier:
        what = "a multi-step task" if task.steps else "a task with a separate verifier"
        return CheckResult(task.task_id, mode, None, f"{what} is checked in its image: run "
                           "`tmax images build` (its checks run it in sandboxes)",
                           round(time.monotonic() - start, 2))
    log: list[str] = []
    with tempfile.TemporaryDirectory(prefix=f"tmax-check-{task.task_id}-") as tmp:
        try:
            box = HostSandbox(task, Path(tmp))
            log = box.log
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
                           round(time.monotonic() - start, 2), "\n".join(log))
