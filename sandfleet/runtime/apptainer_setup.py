"""What the apptainer runtime needs from the node, checked before a sandbox starts.

``find_apptainer`` picks the binary: ``$SANDFLEET_APPTAINER``, else ``apptainer`` on PATH,
else sandfleet's own ``tmax-apptainer`` (``WRAPPER``, shipped in the package; Debian sid's
Apptainer in a root made by ``bin/tmax-setup-apptainer``). ``probe`` then refuses, naming what is missing and what to
do, rather than start a weaker sandbox: no apptainer, one older than ``MIN_VERSION``, and
for an ordinary user (who has no setuid starter here, so runs in user namespaces, with
``--fakeroot``) user namespaces turned off or no FUSE (squashfuse, fuse2fs and
fuse-overlayfs mount the image and the overlay).

``make_overlay`` makes a sandbox's writable layer: a sparse ext3 image with ``upper`` and
``work`` owned by (fake)root, as ``apptainer overlay create --fakeroot`` makes it, but in
milliseconds whatever its size (that command writes its whole inode tables: 38 s and 69 MB
for 10 GiB here) with ``mkfs.ext3`` and ``debugfs`` from e2fsprogs (7.5 MB for 10 GiB).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from sandfleet.errors import SandboxStartError
from sandfleet.runtime.apptainer_memory import NOTE as MEMORY_NOTE
from sandfleet.runtime.apptainer_memory import cgroup_v2_delegated
from sandfleet.runtime.apptainer_verify import NOT_GUARANTEED as VERIFIER_NOT_GUARANTEED

MIN_VERSION = (1, 1, 0)
"""``instance start --pid-file``, ``--writable-tmpfs``/``--overlay`` with ``--fakeroot`` in
user namespaces, ``instance list --json``."""
WRAPPER = Path(str(files("sandfleet.runtime").joinpath("tmax-apptainer"))).resolve()
"""Shipped in the package (the checkout's bin/tmax-apptainer links to it)."""

START_ACTION = "#!/bin/sh\n# sandfleet: the instance needs no start script of the image\nexit 0\n"
"""Bound over the image's ``/.singularity.d/actions/start``: images built by TMax's local
builder carry an empty ``actions`` folder, and ``instance start`` needs that file."""

SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")


@dataclass(frozen=True)
class ApptainerInfo:
    path: str
    version: tuple[int, int, int]
    rootless: bool
    """Running as an ordinary user: ``--userns --fakeroot``, no cgroup limits."""
    wrapper: bool
    """sandfleet's tmax-apptainer (which provides its own 0666 /dev/fuse)."""


def find_apptainer(name: str = "apptainer") -> str | None:
    if os.environ.get("SANDFLEET_APPTAINER"):
        return os.environ["SANDFLEET_APPTAINER"]
    found = shutil.which(name)
    if found:
        return found
    if name == "apptainer" and os.access(WRAPPER, os.X_OK):
        return str(WRAPPER)
    return None


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``apptainer version 1.4.5`` (or ``1.3.0-rc.1``, ``1.2.5-1.el8``) -> (1, 4, 5)."""
    m = re.search(r"(\d+)\.(\d+)\.(\d+)", text)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


USERNS_SWITCHES = ("/proc/sys/user/max_user_namespaces",
                   "/proc/sys/kernel/unprivileged_userns_clone")


def userns_problem(switches: tuple[str, ...] = USERNS_SWITCHES) -> str | None:
    """Why this user cannot make user namespaces (a switch at 0), or None."""
    for path in switches:
        try:
            if Path(path).read_text().strip() == "0":
                return (f"user namespaces are off ({path} is 0; as root: sysctl -w "
                        f"{path[len('/proc/sys/'):].replace('/', '.')}=1 or more)")
        except OSError:
            continue
    return None


def fuse_problem(wrapper: bool, node: Path = Path("/dev/fuse")) -> str | None:
    """Why FUSE cannot be used by this user, or None (the wrapper binds its own node)."""
    if not node.exists():
        return f"no {node} (as root: modprobe fuse)"
    if not wrapper and not os.access(node, os.R_OK | os.W_OK):
        return f"{node} is not readable and writable by this user (chmod 0666 /dev/fuse)"
    return None


def probe(name: str = "apptainer", timeout: float = 60.0) -> ApptainerInfo:
    """The apptainer to use, checked; SandboxStartError naming what is missing."""
    path = find_apptainer(name)
    if path is None:
        raise SandboxStartError("-", f"no {name} on this node: install Apptainer >= "
                                f"{'.'.join(map(str, MIN_VERSION))} (or `module load "
                                "apptainer`), or run bin/tmax-setup-apptainer as root")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True,
                             timeout=timeout, stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SandboxStartError("-", f"{path} --version failed: {e}") from None
    version = parse_version(out.stdout) if out.returncode == 0 else None
    if version is None:
        raise SandboxStartError("-", f"{path} --version gave no version "
                                f"({out.returncode}): {(out.stdout + out.stderr)[-500:]}")
    if version < MIN_VERSION:
        raise SandboxStartError("-", f"{path} is Apptainer {'.'.join(map(str, version))}; "
                                f"sandfleet needs >= {'.'.join(map(str, MIN_VERSION))}")
    wrapper = Path(path).resolve() == WRAPPER
    rootless = os.geteuid() != 0
    if rootless:
        for problem in (userns_problem(), fuse_problem(wrapper)):
            if problem:
                raise SandboxStartError("-", f"rootless Apptainer needs user namespaces and "
                                        f"FUSE: {problem}")
    return ApptainerInfo(path, version, rootless, wrapper)


def _tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))


def make_overlay(path: Path, size_mb: int, *, hide: tuple[str, ...] = (),
                 timeout: float = 300.0) -> None:
    """A sparse ext3 overlay image of ``size_mb`` at ``path`` (see the module doc), with
    a whiteout for each of ``hide`` (absolute paths one folder deep, as /.tmax/verifier):
    the agent's view has no such entry, and nothing it can do brings the image's back."""
    mkfs, debugfs = _tool("mkfs.ext3"), _tool("debugfs")
    if not (mkfs and debugfs):
        raise OSError("the apptainer runtime makes each sandbox's overlay with mkfs.ext3 and "
                      "debugfs: install e2fsprogs")
    with open(path, "wb") as f:
        f.truncate(size_mb << 20)
    script = ["mkdir upper", "mkdir work"]
    for hidden in hide:  # (debugfs's mknod links the name given into its current folder)
        parent, name = os.path.split(hidden.strip("/"))
        script += [f"mkdir upper/{parent}"] if parent else []
        script += [f"cd /upper/{parent}", f"mknod {name} c 0 0", "cd /"]
    steps = [([mkfs, "-q", "-F", "-b", "4096", "-J", "size=4", "-E", "root_owner=0:0",
               str(path)], None),
             ([debugfs, "-w", "-f", "-", str(path)], "\n".join(script) + "\n")]
    for argv, stdin in steps:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                             input=stdin, stdin=None if stdin else subprocess.DEVNULL,
                             check=False)
        if out.returncode != 0 or ("debugfs:" in out.stderr and "error" in out.stderr.lower()):
            raise OSError(f"{' '.join(argv)} failed ({out.returncode}): "
                          f"{(out.stdout + out.stderr)[-800:]}")


def holders(path: Path, proc: Path = Path("/proc")) -> list[int]:
    """The processes (of those this user may look into) with ``path`` open."""
    target, found = str(path), []
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            fds = os.listdir(f"{entry.path}/fd")
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                if os.readlink(f"{entry.path}/fd/{fd}") == target:
                    found.append(int(entry.name))
                    break
            except OSError:
                continue
    return found


def wait_released(path: Path, timeout: float) -> list[int]:
    """Wait until no process has the overlay image ``path`` open, at most ``timeout``
    seconds; the processes that still have it ([] once released). ``instance stop`` and
    ``exec`` return while the container's fuse2fs may still be writing the image back:
    the next container over it (the verifier's, the instance started again) must not
    mount it before that is done."""
    deadline = time.monotonic() + timeout
    delay = 0.002
    while (left := holders(path)) and time.monotonic() < deadline:
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
    return left


def unenforced_limits(cgroup_limits: bool, why: str = "") -> list[str]:
    """The spec's limits the apptainer runtime does not enforce per sandbox (``why``: why
    Apptainer's rootless cgroups are not used)."""
    if cgroup_limits:
        return []
    return [MEMORY_NOTE + (f"; Apptainer's own --memory is not used: {why}" if why else ""),
            ("cpus: pinned with taskset, not bounded: a process inside may widen its "
             "affinity within the worker's CPUs")]


NOT_GUARANTEED = [*VERIFIER_NOT_GUARANTEED,
    ("user: an instance's commands all run as one user (root, or fakeroot rootless); a "
     "task's [agent] or [verifier] user is not applied"),
]
"""What the apptainer runtime cannot give that the local runtime does, whoever runs it."""
AS_ROOT = ("root: root inside is host uid 0 (a user namespace mapping 0 to 0): it writes the "
           "host's kernel settings in /proc/sys and the cgroup files in /sys/fs/cgroup (its "
           "own memory limit, other instances' cgroups), mounts and makes namespaces inside; "
           "a full /dev/shm gets the instance OOM-killed (tests/integration/test_seal_inside.py)")
"""What it cannot give when run as root (an ordinary user's root inside is that user)."""
ROOT_REFUSAL = ("Apptainer run as root gives the sandbox host root: " + AS_ROOT.split(": ", 1)[1]
                + ". Run the worker as an ordinary user (the cluster case: root inside is then that "
                "user), or, on a machine where nothing else runs, accept it with the fleet's "
                "`apptainer_allow_root: true` (ApptainerRuntime(allow_host_root=True))")
"""Why a root worker's apptainer runtime refuses to start sandboxes unless allowed."""


def report(name: str = "apptainer") -> dict:
    """For ``sandfleet doctor``: the apptainer found, or why none is usable, and what it
    does not enforce here."""
    try:
        info = probe(name, timeout=30)
    except SandboxStartError as e:
        return {"usable": False, "problem": e.reason}
    why = cgroup_v2_delegated() if info.rootless else None
    return {"usable": True, "path": info.path, "version": ".".join(map(str, info.version)),
            "rootless": info.rootless, "wrapper": info.wrapper,
            "not_enforced": unenforced_limits(why is None, why or ""),
            "not_guaranteed": NOT_GUARANTEED + ([] if info.rootless else [AS_ROOT])}
