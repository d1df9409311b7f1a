"""The local runtime's verifier: a ``VerifierPlan`` (``sandfleet.verifier.plan``) applied
to a sealed bubblewrap sandbox, and the verifier run in a process tree of its own.

Applying a plan, with the agent frozen: the host makes the plan's fixes in the agent's
tree through the sandbox's mount namespace (the monitor's /proc root), following no link
(``_TreeFixer``); ``VERIFIER_SH`` makes the verifier's own mounts (a tmpfs with its tests,
logs and the plan's files, the image's tools and PATH folders under overlays whose upper
layers are on that tmpfs); bwrap binds the image's entries and the agent's top-level
entries into the verifier's root; the agent's entries under the mounts are made immutable
while the verifier runs (``_Immutable``), so the thawed agent cannot detach them.
"""

from __future__ import annotations

import array
import errno
import fcntl
import logging
import os
import shutil
import signal
import stat as _stat
import subprocess
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from sandfleet.errors import SandboxLost, SandboxStartError
from sandfleet.runtime.base import ExecResult, kill_group, proc_start_time, run_capture
from sandfleet.runtime.bwrap import DEFAULT_PATH, BwrapSpec
from sandfleet.runtime.helper import VERIFIER_TOOLS, db_lines, resolve_user, user_ids
from sandfleet.runtime.local_host import (
    UID_COUNT,
    Cgroups,
    SandboxRecord,
    _kill,
    _read,
    enter_argv,
    helper_argv,
    sandbox_bwrap,
)
from sandfleet.runtime.verify_additions import MERGED, stage_additions
from sandfleet.verifier.plan import PRISTINE, VERIFIER_ENV, Fix, VerifierPlan, plan_view
from sandfleet.verifier.tree import DirTree

log = logging.getLogger(__name__)

# Host side of the verifier: join the cgroups given before "--", exec the rest (nsenter).
JOIN_SH = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
VERIFIER_SH = r"""
v=$1 t=$4 l=$5
mount -t tmpfs -o "size=$2,mode=0755" tmpfs "$v" &&
    mkdir "$v/top" && cp -a -- "$t/tests" "$v/top/tests" && cp -a -- "$t/files" "$t/dirs" "$v/" &&
    mkdir "$v/logs" "$v/top/dev" "$v/top/proc" && : > "$v/empty" && chown -R -- "$3" "$v" &&
    chmod 0777 "$v/logs" || exit 125
if [ "$6" != - ]; then
    meta=
    if [ "$8" != - ]; then meta=,metacopy=on; fi
    mkdir "$v/tools" "$v/.up" "$v/.work" && chown -- "$3" "$v/.up" &&
        mount -t overlay overlay -o "lowerdir=$6,upperdir=$v/.up,workdir=$v/.work$meta"             "$v/tools" || exit 125
    if [ "$8" != - ]; then chown -R -h -P -- "$8" "$v/tools" || exit 125; fi
fi
if [ "$7" != - ]; then
    set -f; i=0; IFS=:
    for low in $7; do
        mkdir "$v/r$i" "$v/.u$i" "$v/.w$i" && chown -- "$3" "$v/.u$i" &&
            mount -t overlay overlay -o "lowerdir=$low,upperdir=$v/.u$i,workdir=$v/.w$i"                 "$v/r$i" || exit 125
        i=$((i + 1))
    done
    unset IFS; set +f
fi
if [ "$9" != - ]; then
    set -f; i=0; IFS=:
    for pair in $9; do
        mkdir "$v/s$i" && mount -t overlay overlay -o "lowerdir=${pair%%,*}:${pair#*,}" \
            "$v/s$i" || exit 125
        i=$((i + 1))
    done
    unset IFS; set +f
fi
shift 9
"$@"; code=$?
cp -a -- "$v/logs/." "$l/" || exit 125
exit $code
"""
"""The verifier's own mounts, made as host root in a private copy of the sandbox's mount
namespace before it starts: a tmpfs at $1 of size $2 (charged to the sandbox's memory
cgroup, so what the verifier writes is bounded, and out of the agent's sight), owned by $3,
holding its root folder "top" with a copy of the staged tests ($4/tests), the plan's files
and folders ($4/files, $4/dirs), an empty logs folder writable by all (as Harbor makes
/logs/verifier) and an empty file "empty"; the image's verifier tools ($6, or -) at "tools"
and each of the image's PATH folders (the colon-separated $7, or -) at r0, r1... under
writable overlays whose upper layers are on that tmpfs (the image is never written); with
$8 (not "-"), the tools' overlay copies metadata only and its files are owned by host ids
$8 (the verifier's user: its tools, as its own cache would be; links not followed); each
"IMAGE,ADDED" pair of $9 (colon-separated, or -) at s0, s1...: the image's folder over the
agent's additions to it (``verify_additions``), read-only. Then
the rest (bwrap as the sandbox's uid, holding the verifier's namespaces: ``VERIFIER_HOLD``),
then what the verifier left in logs copied (links as links) to host folder $5."""
VERIFIER_START = ["/bin/sh", "-c", ('cd "$0" 2>/dev/null || { echo "sandfleet verify: cannot '
                                    'enter $0: started in /" >&2; cd /; }; exec "$@"')]
"""The verifier's command starts in its working directory ($0), or in / where the agent
made that unusable (removed it, or put a link or a file there): what it left is graded,
never an error it could choose (Docker's exec would fail). Nothing is made on the host's
side for it (a link there would lead outside the sandbox)."""
VERIFIER_HOLD = ["/bin/sh", "-c", "kill -STOP $$"]
"""What bwrap runs in the verifier's namespaces (its own init as pid 1 above it): a process
that stops itself, so the namespaces stay until the runtime ends them. The verifier's
command is entered into them (``helper.py enter``), not run by bwrap, whose
no_new_privs it would inherit: a set-user-ID program of the image must work for a
verifier that runs as the image's user, as under Docker."""
FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_IMMUTABLE_FL = 0x80086601, 0x40086602, 0x10
VERIFIER_SPACE_MB = 256
"""Room on the verifier's tmpfs beyond its tests (for /logs/verifier, and what it writes
in /tests)."""
Ids = tuple[int, int, list[int], str]


class LocalVerifier:
    """``verify`` for ``LocalRuntime`` (a mixin: it uses the runtime's records, cgroups,
    mount points and entry commands)."""

    if TYPE_CHECKING:  # what LocalRuntime (and CommandRuntime) give it
        mnt: Path
        cgroups: Cgroups
        start_timeout_s: float
        max_output_bytes: int
        copy_timeout_s: float

        def _live(self, sandbox_id: str) -> SandboxRecord: ...
        def _check_alive(self, sandbox_id: str) -> None: ...
        def _dir(self, sandbox_id: str) -> Path: ...
        def _cgroup_name(self, sandbox_id: str) -> str: ...
        def _procs_files(self, record: SandboxRecord, *, freezer: bool = True
                         ) -> list[str]: ...
        def _cpus(self, record: SandboxRecord) -> list[int] | None: ...
        def _host_env(self) -> dict[str, str]: ...
        def _userns_ready(self, info_r: int, block_w: int, uid_base: int,
                          deadline: float) -> int | None: ...

    def verify(self, sandbox_id: str, command: list[str], *, tests: Path, logs: Path,
               timeout: float, cwd: str | None = None, env: dict[str, str] | None = None,
               agent_system: bool = False, user: str = "") -> ExecResult:
        """Run ``command`` (the task's verifier) beside the sandbox, in a process tree of
        its own that no agent process can see, signal or trace: new pid, mount, ipc, uts
        and user namespaces, the sandbox's network. Its root is a folder of its own holding
        the agent's final file system's top-level entries (its folders bound, so what either
        writes there the other sees) and, as a plain folder, a copy of host folder ``tests``
        as /tests (one a test.sh can move away and back); the image's own ``PRISTINE``
        directories and ``PRISTINE_ETC`` entries are bound over the agent's (unless
        ``agent_system``), and a fresh folder covers /logs/verifier. Its root, its tests and
        logs are on a tmpfs of the verifier's own (bounded, in the sandbox's memory cgroup);
        what it leaves in /logs/verifier is copied to host folder ``logs`` at the end: the
        only place it writes that the caller reads. The agent is frozen while that view is
        built and thawed once the verifier's command runs (a server it left running can
        answer); its files and folders that the verifier's mounts cover are immutable until
        the verifier ends (``_Immutable``). An agent root of more than ``TOP_LEVEL_MAX``
        entries is bound whole instead, the tests over its /tests, and the agent, whose
        live root that is, stays frozen until the verifier ends; so it does where its
        files cannot be made immutable. What the verifier sees beyond that (the image's
        PATH folders, uv's installer stand-in, Python's import order) is the plan's:
        ``sandfleet.verifier.plan``.

        ``command`` runs as ``user`` (Docker's USER; "" for root) as the image's own
        /etc/passwd and /etc/group name it, not the agent's copies (which the agent may
        have rewritten, to choose who grades it), with that user's home as HOME unless
        ``env`` sets one: as ``docker exec -u`` (or Harbor's verifier as the image's USER)
        runs it; a non-root user gets no capabilities, and the verifier tools' overlay
        is its own. A user the image does not name exits 126 with why, as Docker's exec
        fails."""
        record = self._live(sandbox_id)
        self._check_monitor(record)
        try:
            ids = self._image_user(record, user) if user else None
        except OSError as e:
            return ExecResult(f"sandfleet verify: {e}\n", 126, False, False, 0.0)
        logs = Path(logs)
        logs.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="verify-", dir=self._dir(sandbox_id)) as tmp:
            staged = Path(tmp) / "stage"
            shutil.copytree(tests, staged / "tests", symlinks=True)
            for sub in ("files", "dirs"):
                (staged / sub).mkdir(mode=0o755)
            size_mb = (_tree_bytes(staged) >> 20) + VERIFIER_SPACE_MB
            return self._run_verifier(record, staged, logs, size_mb, command, timeout=timeout,
                                      cwd=cwd, env=env, agent_system=agent_system, ids=ids,
                                      setup_log=Path(tmp) / "setup.log")

    def _image_user(self, record: SandboxRecord, user: str) -> Ids:
        """``user``'s uid, gid, groups and home as the image's /etc/passwd and /etc/group
        name them (read through the sandbox's mount namespace, no link followed); an
        OSError for a name the image has not, or an id outside the sandbox's range."""
        image = DirTree(f"/proc/{record.monitor_pid()}/root{self.mnt / 'image'}")
        texts = [image.read(f"/etc/{name}", 1 << 20) if image.kind("/etc") == "dir"
                 else "" for name in ("passwd", "group")]
        uid, gid, groups, home = resolve_user(user, (db_lines(texts[0]), db_lines(texts[1])),
                                              where="image")
        if not all(0 <= i < UID_COUNT for i in (uid, gid, *groups)):
            raise OSError(f"user {user!r} has ids outside the sandbox's 0-{UID_COUNT - 1}")
        return uid, gid, groups, home

    def _run_verifier(self, record: SandboxRecord, tests: Path, logs: Path, size_mb: int,
                      command: list[str], *, timeout: float, cwd: str | None,
                      env: dict[str, str] | None, agent_system: bool,
                      ids: Ids | None, setup_log: Path) -> ExecResult:
        """bwrap builds the verifier's namespaces and holds them (``VERIFIER_HOLD``); the
        command is entered into them as ``ids`` (None: root) and, once it has ended, the
        hold's pid 1 is killed, which ends whatever the command left there; then
        ``VERIFIER_SH`` copies the logs out."""
        freezer = Path(self.cgroups.paths(self._cgroup_name(record.sandbox_id))["freezer"])
        if not Cgroups.freeze(freezer, True):  # it cannot be kept from racing: end it
            log.warning("sandbox %s: agent would not freeze; killing its processes",
                        record.sandbox_id)
            for pid in _read(str(freezer / "cgroup.procs")).split():
                if int(pid) != record.init_pid():
                    _kill(int(pid))
        guards = _Immutable(f"/proc/{record.monitor_pid()}/root")
        info_r, info_w = os.pipe()
        block_r, block_w = os.pipe()
        fds = {info_r, info_w, block_r, block_w}
        host: subprocess.Popen | None = None
        hold = -1  # a pidfd of the hold's pid 1

        def close(fd: int) -> None:  # once: another thread may get the number next
            if fd in fds:
                fds.discard(fd)
                os.close(fd)

        try:
            base_env = {"PATH": DEFAULT_PATH, "HOME": ids[3] if ids else "/root",
                        **VERIFIER_ENV, **(env or {})}
            spec, plan = self._verifier_view(record, agent_system, path=(env or {}).get("PATH"),
                                             cwd=cwd, home=base_env["HOME"], ids=ids,
                                             stage=tests)
            # the thawed agent cannot remove (and so detach) the verifier's mount points in
            # its tree; where they cannot be held so, or its live root is the verifier's
            # (more than TOP_LEVEL_MAX names at /), it stays frozen until the verifier ends
            frozen = plan.root == "whole" or not guards.hold(
                f"{self.mnt / 'root'}{path}" for path in plan.guarded)
            uid = ids[0] if ids else 0
            env = plan.env(base_env)  # the tools' settings, the image's folders first
            merged = self._additions(record, plan, spec, env.get("PATH", ""), tests)
            bwrap = sandbox_bwrap(root=spec.root, network=True,
                                  hostname=record.spec["hostname"], info_fd=info_w,
                                  block_fd=block_r, command=VERIFIER_HOLD, binds=spec,
                                  cwd="/", env={"PATH": DEFAULT_PATH})
            base = record.uid_base
            image = self.mnt / "image"
            tools = f"{image}{VERIFIER_TOOLS}" if any(
                m.source == "tools" for m in plan.mounts) else "-"
            overlays = [f"{image}{m.source.partition(':')[2]}" for m in plan.mounts
                        if m.source.startswith("overlay:")]
            argv = (["sh", "-c", JOIN_SH, "sh", *self._procs_files(record, freezer=False),
                     "--", "nsenter", f"--mount=/proc/{record.monitor_pid()}/ns/mnt",
                     f"--net=/proc/{record.init_pid()}/ns/net", "--",
                     "unshare", "-m", "--propagation", "private", "--",
                     "sh", "-c", VERIFIER_SH, "sh", str(self.mnt / "verifier"), f"{size_mb}m",
                     f"{base}:{base}", str(tests), str(logs), tools,
                     ":".join(overlays) or "-",
                     f"{base + uid}:{base + ids[1]}" if ids and uid else "-",
                     ":".join(merged) or "-", "setpriv", f"--reuid={base}", f"--regid={base}", "--clear-groups", "--"]
                    + bwrap)
            with open(setup_log, "wb") as out:
                host = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, env=self._host_env(),
                                        start_new_session=True, pass_fds=(info_w, block_r))
            close(info_w)
            close(block_r)
            deadline = time.monotonic() + self.start_timeout_s
            child = self._userns_ready(info_r, block_w, base, deadline)
            try:
                hold = os.pidfd_open(child) if child else -1
            except ProcessLookupError:
                child = None
            while child and not _command_started(child) \
                    and host.poll() is None and time.monotonic() < deadline:
                time.sleep(0.002)  # its mounts are in place once the hold runs
            started = child is not None and _command_started(child)
            if not frozen or not started:
                Cgroups.freeze(freezer, False)
            if child is None or not started:
                kill_group(host.pid)  # its host side may still be making mounts
                host.wait()
                tail = setup_log.read_text(errors="replace")[-1500:]
                raise SandboxStartError(record.sandbox_id, f"verifier did not start: {tail}")
            who = user_ids(uid, ids[1], ids[2]) if ids else ""
            if uid and not agent_system:  # the image's set-user-ID programs work, as in Docker
                self._allow_setuid(child, [dest for src, dest in spec.ro_binds
                                           if dest.lstrip("/") in PRISTINE])
            # the OOM killer's choice is what the agent left running (its oom_score_adj),
            # and at the deadline all of the verifier ends, what left its group too
            output, code, timed_out, seconds = run_capture(
                enter_argv(init_pid=child, cgroup_procs=self._procs_files(record, freezer=False),
                           cpus=self._cpus(record), cwd="/", env=env, user=who,
                           argv=[*VERIFIER_START, cwd or record.spec["workdir"], *command],
                           oom_score_adj=0),
                timeout=timeout, env=self._host_env(), limit=self.max_output_bytes,
                on_timeout=lambda: _pidfd_kill(hold))
            _pidfd_kill(hold)  # the verifier's processes end with its pid 1
            try:
                copied = host.wait(timeout=self.copy_timeout_s)  # its logs copied out
            except subprocess.TimeoutExpired:
                copied = -1
            if copied == 125:
                tail = setup_log.read_text(errors="replace")[-1500:]
                output += f"\nsandfleet verify: its logs were not all copied: {tail}"
        finally:
            if host is not None and host.poll() is None:
                _pidfd_kill(hold)
                kill_group(host.pid)
                host.wait()
            if hold >= 0:
                os.close(hold)
            guards.release()
            Cgroups.freeze(freezer, False)  # (again, if it failed before: idempotent)
            for fd in sorted(fds):  # (a copy: close() changes the set)
                close(fd)
        self._check_alive(record.sandbox_id)
        return ExecResult(output, code, timed_out, False, seconds)

    def _additions(self, record: SandboxRecord, plan: VerifierPlan, spec: BwrapSpec,
                   path: str, staged: Path) -> list[str]:
        """What the agent added to the image's system folders (``MERGED``) copied into
        "added" beside ``staged`` (the verifier's staged tests and files), and the bwrap
        sources of those folders changed to the overlays ``VERIFIER_SH`` makes of them ("IMAGE,ADDED" pairs, in order). None with
        ``agent_system`` (the agent's own folders are the verifier's) or
        ``SANDFLEET_VERIFIER_ADDITIONS=0`` (the image's folders only)."""
        if plan.agent_system or os.environ.get("SANDFLEET_VERIFIER_ADDITIONS") == "0":
            return []
        ns = f"/proc/{record.monitor_pid()}/root"
        image, added = str(self.mnt / "image"), staged.parent / "added"
        bound = [dest for source, dest in spec.ro_binds
                 if dest in MERGED and source == f"{image}{dest}"]
        try:
            got = stage_additions(f"{ns}{image}",
                                  f"{ns}{self._dir(record.sandbox_id)}/disk/upper",
                                  added, bound, path, staged / "tests")
        except OSError as e:  # graded on the image's folders alone, as before
            log.warning("sandbox %s: the agent's additions to %s not copied for the "
                        "verifier: %s", record.sandbox_id, ", ".join(bound), e)
            return []
        pairs: list[str] = []
        for k, (_source, dest) in enumerate(spec.ro_binds):
            if dest in got:
                spec.ro_binds[k] = (str(self.mnt / "verifier" / f"s{len(pairs)}"), dest)
                pairs.append(f"{image}{dest},{added}{dest}")
        return pairs

    def _allow_setuid(self, pid: int, paths: list[str]) -> None:
        """Clear nosuid on mount points ``paths`` (the image's own folders) of the
        verifier's mount namespace (pid 1 ``pid``); where the kernel refuses, the verifier
        runs without (logged)."""
        if not paths:
            return
        out = subprocess.run(helper_argv("suid", str(pid), *paths), capture_output=True,
                             text=True, env=self._host_env(), timeout=60, check=False)
        if out.returncode != 0:
            log.warning("verifier: set-user-ID programs will not work: %s", out.stderr.strip())

    def _check_monitor(self, record: SandboxRecord) -> None:
        if record.monitor is None or proc_start_time(record.monitor[0]) != record.monitor[1]:
            raise SandboxLost(record.sandbox_id, "its mount namespace is gone")


    def _verifier_view(self, record: SandboxRecord, agent_system: bool, *, path: str | None,
                       cwd: str | None, home: str, ids: Ids | None, stage: Path
                       ) -> tuple[BwrapSpec, VerifierPlan]:
        """The verifier's plan (``plan_view`` over the image and the agent's final tree,
        read through the sandbox's mount namespace) applied: its fixes made in the agent's
        tree (``_TreeFixer``; the agent is frozen), its files and folders staged in
        ``stage`` for ``VERIFIER_SH``, its mounts as a bwrap spec."""
        self._check_monitor(record)
        ns = f"/proc/{record.monitor_pid()}/root"
        root, image, mine = str(self.mnt / "root"), str(self.mnt / "image"), self.mnt / "verifier"
        plan = plan_view(DirTree(f"{ns}{image}"), DirTree(f"{ns}{root}"), path=path,
                         workdir=record.spec["workdir"], cwd=cwd, home=home,
                         agent_system=agent_system, nonce=os.urandom(4).hex())
        user = (record.uid_base + ids[0], record.uid_base + ids[1]) if ids else None
        fixer = _TreeFixer(f"{ns}{root}", record.uid_base, user,
                           f"{ns}{self._dir(record.sandbox_id)}/disk/reserve")
        for fix in plan.fixes:
            fixer.apply(fix)
        for name, text in plan.files.items():
            _stage_file(stage / "files" / name, text)
        for name, files in plan.dirs.items():
            for file, text in files.items():
                _stage_file(stage / "dirs" / name / file, text)
        spec = BwrapSpec(root=root, env={})
        if plan.root == "entries":  # its own /, the agent's entries in it
            spec.root = str(mine / "top")
            for name, kind, target in plan.entries:
                if kind == "link":  # as it is (it resolves in the verifier's root)
                    spec.symlinks.append((target, f"/{name}"))
                else:  # (its mounts with it)
                    spec.root_binds.append((f"{root}/{name}", f"/{name}"))
        overlays = 0
        for mount in plan.mounts:
            kind, _, where = mount.source.partition(":")
            if kind == "logs" and plan.root == "whole":
                spec.binds.append((str(mine / "top" / "tests"), "/tests"))
            if kind == "overlay":
                source = str(mine / f"r{overlays}")
                overlays += 1
            else:
                source = {"image": f"{image}{where}", "tools": f"{mine}/tools{where}",
                          "file": f"{mine}/files/{where}", "dir": f"{mine}/dirs/{where}",
                          "empty": f"{mine}/empty", "logs": f"{mine}/logs"}[kind]
            (spec.binds if mount.writable else spec.ro_binds).append((source, mount.dest))
        return spec, plan


def _stage_file(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    path.parent.chmod(0o755)
    path.write_text(text)
    path.chmod(0o644)


class _TreeFixer:
    """Applies a plan's fixes to the agent's tree under ``base`` (a /proc/<pid>/root plus
    the tree's mount point), as host root, never following a link at a fix's path (the
    plan made every folder above it a real one first). What it makes is owned by the
    sandbox's root (host ``uid``), or by the verifier's user (host ``user``) where the
    plan says so."""

    def __init__(self, base: str, uid: int, user: tuple[int, int] | None, reserve: str):
        self.base, self.uid, self.user, self.reserve = base, uid, user, reserve

    def _make(self, make) -> None:
        """``make()``, freeing the disk's reserve (blocks and inodes held outside the
        agent's layer since the start) while it fails for lack of space: an agent that
        filled its disk still gets graded."""
        while True:
            try:
                return make()
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                try:
                    left = sorted(os.listdir(self.reserve))
                except OSError:
                    left = []
                if not left:
                    raise
                os.unlink(f"{self.reserve}/{left[0]}")

    def apply(self, fix: Fix) -> None:
        path = f"{self.base}{fix.path}"
        uid, gid = self.user if fix.user and self.user else (self.uid, self.uid)
        if fix.op == "set_aside":
            try:
                os.lstat(path)
            except FileNotFoundError:
                return
            os.rename(path, f"{self.base}{fix.target}")
        elif fix.op == "mkdir":
            self._make(lambda: os.mkdir(path, 0o755))
        elif fix.op == "symlink":
            self._make(lambda: os.symlink(fix.target, path))
        elif fix.op == "touch":
            self._make(lambda: os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY
                                                | os.O_NOFOLLOW, 0o644)))
        else:
            raise ValueError(f"verifier plan: unknown fix {fix.op!r}")
        if fix.op != "set_aside":
            os.lchown(path, uid, gid)


class _Immutable:
    """Entries of the agent's tree made immutable (``FS_IMMUTABLE_FL``) while the verifier
    runs, through descriptors held until ``release``: the agent's processes (no
    CAP_LINUX_IMMUTABLE) can then neither remove nor rename them, and so cannot detach the
    verifier's mounts on them (Linux detaches a mount in every namespace once its mount
    point is removed in any, since 3.18), nor add entries to those folders."""

    def __init__(self, ns: str):
        self.ns = ns
        self.held: list[tuple[int, int]] = []

    def hold(self, paths: Iterable[str]) -> bool:
        """Each of ``paths`` (sandbox paths under ``ns``, the agent frozen: no link
        followed at the last component, the others made real folders), in order; False
        when one cannot be held (a file system without the flag, a full disk)."""
        for path in paths:
            fd = -1
            try:
                fd = os.open(f"{self.ns}{path}",
                             os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
                mode = os.fstat(fd).st_mode
                if not (_stat.S_ISDIR(mode) or _stat.S_ISREG(mode)):
                    raise OSError(errno.EINVAL, "neither a folder nor a file")
                flags = array.array("i", [0])
                try:
                    fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags, True)
                except OSError as e:  # only in the image's (squashfs) layer: copied up by
                    if e.errno != errno.ENOTTY:  # setting its times as they are, its
                        raise                    # flags are then the writable layer's
                    st = os.fstat(fd)
                    os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))
                    fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags, True)
                old = flags[0]
                flags[0] = old | FS_IMMUTABLE_FL
                fcntl.ioctl(fd, FS_IOC_SETFLAGS, flags, True)
            except OSError as e:
                if fd >= 0:
                    os.close(fd)
                log.warning("verifier: cannot hold %s in the agent's tree (%s)", path, e)
                return False
            self.held.append((fd, old))
        return True

    def release(self) -> None:
        """Their flags as they were, the descriptors closed."""
        while self.held:
            fd, old = self.held.pop()
            try:
                fcntl.ioctl(fd, FS_IOC_SETFLAGS, array.array("i", [old]), True)
            except OSError as e:  # (its sandbox may be gone)
                log.debug("verifier: could not restore flags: %s", e)
            finally:
                os.close(fd)




def _pidfd_kill(fd: int) -> None:
    """SIGKILL to the process of pidfd ``fd`` (-1: none), if it is still there."""
    if fd >= 0:
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _command_started(bwrap_child: int) -> bool:
    """Whether bwrap (its process in the new namespaces given) has set everything up and
    started the command: its own init's child runs something that is not bwrap."""
    for pid in [bwrap_child] + _read(f"/proc/{bwrap_child}/task/{bwrap_child}/children").split():
        comm = _read(f"/proc/{pid}/comm")
        if comm and comm != "bwrap":
            return True
    return False



def _tree_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (links not followed)."""
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            st = os.lstat(os.path.join(dirpath, name))
            total += st.st_size if _stat.S_ISREG(st.st_mode) else 0
    return total
