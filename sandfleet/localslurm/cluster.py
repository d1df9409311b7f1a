"""One local cluster under DIR: its layout, its record (``cluster.json``), its slurm.conf,
starting its daemons (munged, slurmctld, one slurmd per virtual node) and stopping them."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import pwd
import socket
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

from sandfleet import slurm
from sandfleet.localslurm.procs import (
    EXIT_ERROR,
    EXIT_REFUSED,
    RECORD,
    Daemon,
    LocalSlurmError,
    Record,
    atomic_write,
    find_binary,
    is_alive,
    kill_session,
    orphan_steps,
    proc_stat,
    run,
    stop_daemon,
    wait_until,
)

log = logging.getLogger("tmax-local-slurm")


class Layout:
    """Where everything lives under DIR."""

    def __init__(self, root: Path):
        self.root = root
        self.etc = root / "etc"
        self.conf = self.etc / "slurm.conf"
        self.munge = root / "munge"
        self.munge_key = self.munge / "munge.key"
        self.munge_socket = self.munge / "munge.socket.2"
        self.munge_seed = self.munge / "munged.seed"
        self.run = root / "run"
        self.munge_pid = self.run / "munged.pid"
        self.state = root / "state"
        self.spool = root / "spool"
        self.logs = root / "log"
        self.record = root / RECORD
        self.lock = root / ".lock"

    def pid_files(self) -> list[Path]:
        return sorted(self.run.glob("*.pid")) if self.run.is_dir() else []

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}


def default_dir() -> Path:
    env = os.environ.get("TMAX_LOCAL_SLURM_DIR")
    return Path(env) if env else Path.home() / ".tmax" / "local-slurm"


@contextlib.contextmanager
def dir_lock(lay: Layout):
    """Serialise up/down on one DIR."""
    lay.root.mkdir(parents=True, exist_ok=True, mode=0o755)
    owner = lay.root.stat().st_uid
    if owner != os.geteuid():
        raise LocalSlurmError(
            f"{lay.root} belongs to uid {owner}, not to you "
            f"(uid {os.geteuid()}); pick another --dir",
            EXIT_REFUSED,
        )
    with open(lay.lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another tmax-local-slurm on %s", lay.root)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def load_record(lay: Layout) -> Record | None:
    if not lay.record.exists():
        return None
    try:
        return Record.from_json(json.loads(lay.record.read_text()))
    except (ValueError, TypeError) as e:
        raise LocalSlurmError(
            f"{lay.record} is not a cluster record ({e}); remove it by hand", EXIT_REFUSED
        ) from e


def save_record(lay: Layout, rec: Record) -> None:
    atomic_write(lay.record, json.dumps(asdict(rec), indent=2) + "\n")


def log_tail(lay: Layout, lines: int = 15) -> str:
    out = []
    for p in sorted(lay.logs.glob("*")) if lay.logs.is_dir() else []:
        text = p.read_text(errors="replace").splitlines()[-lines:]
        if text:
            out.append(f"--- {p} (last {len(text)} lines)\n" + "\n".join(text))
    return "\n".join(out)


# ---------------------------------------------------------------- config


def free_ports(n: int) -> list[int]:
    """n distinct TCP ports free right now on all interfaces."""
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


CRED_EXPIRE_S = 10
"""AuthInfo cred_expire of the local cluster: step credential lifetime and requeue hold."""


def node_names(n: int) -> list[str]:
    return [f"n{i}" for i in range(1, n + 1)]


def render_conf(
    lay: Layout,
    *,
    host: str,
    user: str,
    ctld_port: int,
    node_ports: list[int],
    cpus: int,
    memory_mb: int,
) -> str:
    names = node_names(len(node_ports))
    lines = [
        "# Written by tmax-local-slurm; rewritten on every fresh `up`.",
        "ClusterName=tmaxlocal",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        f"SlurmUser={user}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire: the job step credential lifetime (default 120 s), which is also how
        # long slurmctld holds a requeued batch job (BeginTime = requeue + cred_expire + 1)
        # so that the old run's credentials have expired on the nodes before it starts
        # again. One host, no paging, no slow prologs: 10 s is ample for a launch here
        # (Slurm's minimum is 5) and a requeued job comes back ~11 s later, not ~2 min.
        f"AuthInfo=socket={lay.munge_socket},cred_expire={CRED_EXPIRE_S}",
        f"StateSaveLocation={lay.state}",
        f"SlurmdSpoolDir={lay.spool}/%n",
        f"SlurmctldPidFile={lay.run}/slurmctld.pid",
        f"SlurmdPidFile={lay.run}/slurmd-%n.pid",
        f"SlurmctldLogFile={lay.logs}/slurmctld.log",
        f"SlurmdLogFile={lay.logs}/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        f"PlugStackConfig={lay.etc}/plugstack.conf",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU_Memory",
        f"DefMemPerCPU={max(1, memory_mb // cpus)}",
        # Virtual nodes declare what they are told, not what the host has.
        "SlurmdParameters=config_overrides",
        "PropagateResourceLimits=NONE",
        "ReturnToService=2",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=30",
        "MessageTimeout=10",
        "InactiveLimit=0",
        "KillWait=5",
        "MinJobAge=300",
        "SchedulerType=sched/backfill",
        # sched_interval: the main scheduler's periodic pass (default 60 s). Nothing wakes
        # the scheduler when a requeued job's BeginTime passes, so without it the job
        # waits for the next backfill pass; with it, it starts within 2 s of eligible.
        "SchedulerParameters=bf_interval=5,sched_interval=2",
        "MailProg=/bin/true",
    ]
    for name, port in zip(names, node_ports):
        lines.append(
            f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
            f"CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN"
        )
    lines.append(
        f"PartitionName=debug Nodes={','.join(names)} Default=YES MaxTime=INFINITE State=UP"
    )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- cluster queries


def sinfo_nodes(lay: Layout) -> list[dict]:
    cp = run(["sinfo", "-h", "-N", "-o", "%N|%T|%c|%m"], env=lay.env(), timeout=15)
    nodes = []
    for line in cp.stdout.splitlines():
        name, state, cpus, mem = line.strip().split("|")
        nodes.append({"name": name, "state": state, "cpus": int(cpus), "memory_mb": int(mem)})
    return nodes


def ctld_up(lay: Layout) -> bool:
    cp = run(["scontrol", "ping"], env=lay.env(), timeout=15, check=False)
    return cp.returncode == 0 and "is UP" in cp.stdout


# ---------------------------------------------------------------- up


def check_not_foreign(lay: Layout, rec: Record | None) -> None:
    """Refuse (exit 2) if DIR or a live process under it belongs to someone else."""
    me = os.geteuid()
    if rec is not None and (rec.uid != me or rec.host != socket.gethostname()):
        raise LocalSlurmError(
            f"the cluster in {lay.root} was started by uid {rec.uid} on host {rec.host}, "
            f"not by uid {me} on {socket.gethostname()}; refusing to touch it",
            EXIT_REFUSED,
        )
    ours = {(d.pid, d.start_time) for d in (rec.daemons if rec else [])}
    for pf in lay.pid_files():
        try:
            pid = int(pf.read_text().split()[0])
        except (ValueError, IndexError, OSError):
            continue
        stat = proc_stat(pid)
        if stat is None or stat[0] in ("Z", "X") or (pid, stat[2]) in ours:
            continue
        raise LocalSlurmError(
            f"{lay.root} is in use by a process this helper did not start: pid {pid} "
            f"(from {pf}); refusing to start over it. Stop that process or pick another --dir",
            EXIT_REFUSED,
        )


def spawn(lay: Layout, rec: Record, name: str, argv: list[str]) -> Daemon:
    """Start a daemon in its own session, logging its stdout/stderr, and record it."""
    with open(lay.logs / f"{name}.out", "ab") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=lay.env(),
            cwd=lay.root,
            start_new_session=True,
            close_fds=True,
        )
    stat = proc_stat(proc.pid)
    if stat is None:
        raise LocalSlurmError(f"{name} exited at once; see {lay.logs}/{name}.out")
    d = Daemon(name=name, pid=proc.pid, start_time=stat[2], argv=argv)
    rec.daemons.append(d)
    save_record(lay, rec)
    log.info("started %s (pid %d)", name, d.pid)
    return d


def wait_for(what: str, pred, timeout: float, daemons: list[Daemon]) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        for d in daemons:
            if not is_alive(d):
                raise LocalSlurmError(f"{d.name} (pid {d.pid}) died while waiting for {what}")
        if time.monotonic() >= deadline:
            raise LocalSlurmError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.3)


def make_munge_key(path: Path) -> None:
    if path.exists():
        return
    atomic_write(path, os.urandom(1024), mode=0o400)


def check_socket_paths(lay: Layout, nodes: int) -> None:
    """AF_UNIX paths hold at most 107 bytes: munge's socket and slurmstepd's step sockets."""
    node = node_names(nodes)[-1]
    longest = max(
        str(lay.munge_socket), str(lay.spool / node / f"{node}_4294967294.4294967294"), key=len
    )
    if len(longest.encode()) > 107:
        raise LocalSlurmError(
            f"{lay.root} is too long a path for unix sockets ({longest!r} > 107 "
            "bytes); pick a shorter --dir",
            EXIT_ERROR,
        )


def start_cluster(lay: Layout, nodes: int, cpus: int, memory_mb: int, timeout: float) -> Record:
    check_socket_paths(lay, nodes)
    binaries = {b: find_binary(b) for b in ("munged", "slurmctld", "slurmd")}
    for b in ("sinfo", "scontrol", "squeue", "scancel"):
        find_binary(b)
    host = socket.gethostname().split(".")[0]
    user = pwd.getpwuid(os.geteuid()).pw_name

    for d in (lay.etc, lay.run, lay.state, lay.logs, lay.spool):
        d.mkdir(parents=True, exist_ok=True, mode=0o755)
    lay.munge.mkdir(exist_ok=True, mode=0o711)
    os.chmod(lay.munge, 0o711)  # munged wants o+x on the socket dir
    for stale in [*lay.pid_files(), lay.munge_socket]:
        stale.unlink(missing_ok=True)
    for name in node_names(nodes):
        (lay.spool / name).mkdir(exist_ok=True)

    ports = free_ports(nodes + 1)
    atomic_write(
        lay.conf,
        render_conf(
            lay,
            host=host,
            user=user,
            ctld_port=ports[0],
            node_ports=ports[1:],
            cpus=cpus,
            memory_mb=memory_mb,
        ),
    )
    atomic_write(lay.etc / "plugstack.conf", "# no SPANK plugins\n")
    make_munge_key(lay.munge_key)

    rec = Record(
        dir=str(lay.root),
        uid=os.geteuid(),
        host=socket.gethostname(),
        conf=str(lay.conf),
        nodes=nodes,
        cpus=cpus,
        memory_mb=memory_mb,
    )
    save_record(lay, rec)
    deadline = time.monotonic() + timeout

    def left() -> float:
        return max(1.0, deadline - time.monotonic())

    try:
        munged = spawn(
            lay,
            rec,
            "munged",
            [
                binaries["munged"],
                "--foreground",
                "--force",
                f"--key-file={lay.munge_key}",
                f"--socket={lay.munge_socket}",
                f"--pid-file={lay.munge_pid}",
                f"--log-file={lay.logs / 'munged.log'}",
                f"--seed-file={lay.munge_seed}",
            ],
        )
        wait_for("the munge socket", lay.munge_socket.exists, left(), [munged])

        ctld = spawn(
            lay, rec, "slurmctld", [binaries["slurmctld"], "-D", "-c", "-f", str(lay.conf)]
        )
        wait_for(
            "slurmctld to answer `scontrol ping`", lambda: ctld_up(lay), left(), [munged, ctld]
        )

        slurmds = [
            spawn(lay, rec, f"slurmd-{n}", [binaries["slurmd"], "-D", "-N", n, "-f", str(lay.conf)])
            for n in node_names(nodes)
        ]

        def all_idle() -> bool:
            got = sinfo_nodes(lay)
            return len(got) == nodes and all(n["state"] == "idle" for n in got)

        wait_for(f"{nodes} idle nodes in sinfo", all_idle, left(), [munged, ctld, *slurmds])
    except BaseException as e:
        tail = log_tail(lay)
        log.error("up failed; stopping what it started (logs kept in %s)", lay.logs)
        stop_all(lay, rec)
        if isinstance(e, LocalSlurmError):
            raise LocalSlurmError(f"{e}\n{tail}", e.exit_code) from e
        raise
    return rec


# ---------------------------------------------------------------- down


def cancel_jobs(lay: Layout, timeout: float = 20.0) -> list[str]:
    """scancel every job of this cluster by id (sandfleet's Slurm client: squeue, then
    ``scancel ID`` each); wait for the queue to drain."""
    client = slurm.SlurmClient(15, {"SLURM_CONF": str(lay.conf)})
    try:
        ids = list(client.queue(me=False))
        for job_id in ids:
            client.cancel(job_id)
    except slurm.SlurmError as e:
        raise LocalSlurmError(str(e)) from e
    if not ids:
        return []

    def drained() -> bool:
        try:
            return not client.queue(me=False)
        except slurm.SlurmError:
            return False

    drained_ok = wait_until(drained, timeout, interval=0.5)
    if not drained_ok:
        log.warning("jobs still listed %.0fs after scancel; stopping the daemons anyway", timeout)
    return ids


def stop_all(lay: Layout, rec: Record) -> list[tuple[Daemon, str]]:
    """Stop recorded daemons (nodes, then controller, then munged); drop the record."""
    results = []
    errors = []
    for d in reversed(rec.daemons):
        try:
            results.append((d, stop_daemon(d)))
        except LocalSlurmError as e:
            errors.append(str(e))
    if errors:
        raise LocalSlurmError("; ".join(errors))
    since = min((d.start_time for d in rec.daemons), default=0)
    for pid, sid in orphan_steps(Path(rec.conf), since):
        killed = kill_session(sid)
        log.warning(
            "killed job steps left behind by a dead slurmd: slurmstepd pid %d, "
            "session %d (%d processes)",
            pid,
            sid,
            len(killed),
        )
    for pf in lay.pid_files():
        pf.unlink(missing_ok=True)
    lay.munge_socket.unlink(missing_ok=True)
    lay.record.unlink(missing_ok=True)
    return results
