"""``tmax-local-slurm up|down|status|env``: the command line of the local cluster helper
(see ``sandfleet.localslurm``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import socket
import sys
import time
from pathlib import Path

from sandfleet.localslurm.cluster import (
    Layout,
    cancel_jobs,
    check_not_foreign,
    ctld_up,
    default_dir,
    dir_lock,
    load_record,
    sinfo_nodes,
    start_cluster,
    stop_all,
)
from sandfleet.localslurm.procs import (
    EXIT_PARTLY_DEAD,
    EXIT_REFUSED,
    LocalSlurmError,
    is_alive,
)

log = logging.getLogger("tmax-local-slurm")

DESCRIPTION = "Start, stop and inspect a throwaway Slurm cluster on this one host."


def cmd_up(args: argparse.Namespace) -> int:
    lay = Layout(args.dir)
    with dir_lock(lay):
        rec = load_record(lay)
        check_not_foreign(lay, rec)
        if rec is not None:
            alive = [d for d in rec.daemons if is_alive(d)]
            dead = [d for d in rec.daemons if not is_alive(d)]
            if alive and dead:
                raise LocalSlurmError(
                    f"the cluster in {lay.root} is partly dead (dead: "
                    f"{', '.join(f'{d.name} pid {d.pid}' for d in dead)}); run "
                    f"`tmax-local-slurm down --dir {lay.root}` first",
                    EXIT_PARTLY_DEAD,
                )
            if alive:
                asked = {"nodes": args.nodes, "cpus": args.cpus, "memory_mb": args.memory_mb}
                diff = {k: v for k, v in asked.items() if v is not None and getattr(rec, k) != v}
                if diff:
                    raise LocalSlurmError(
                        f"a cluster with nodes={rec.nodes} cpus={rec.cpus} "
                        f"memory_mb={rec.memory_mb} already runs in {lay.root}; you asked for "
                        f"{diff}: run `down` first",
                        EXIT_REFUSED,
                    )
                if not ctld_up(lay):
                    raise LocalSlurmError(
                        f"slurmctld in {lay.root} is alive but does not "
                        "answer `scontrol ping`; run `down` first",
                        EXIT_PARTLY_DEAD,
                    )
                log.info(
                    "cluster in %s already up (%d daemons); nothing to do", lay.root, len(alive)
                )
                print(f"export SLURM_CONF={lay.conf}")
                return 0
            log.info("stale record in %s (all daemons dead); starting afresh", lay.root)
            stop_all(lay, rec)  # clears leftover process groups and the record
        t0 = time.monotonic()
        start_cluster(lay, args.nodes or 3, args.cpus or 2, args.memory_mb or 2048, args.timeout)
        log.info("cluster up in %.1fs: %s", time.monotonic() - t0, lay.root)
        print(f"export SLURM_CONF={lay.conf}")
        return 0


def cmd_down(args: argparse.Namespace) -> int:
    lay = Layout(args.dir)
    if not lay.root.exists():
        print(f"no cluster in {lay.root}")
        return 0
    with dir_lock(lay):
        rec = load_record(lay)
        if rec is None:
            print(f"no cluster recorded in {lay.root}; nothing to stop")
            return 0
        if rec.uid != os.geteuid() or rec.host != socket.gethostname():
            raise LocalSlurmError(
                f"the cluster in {lay.root} belongs to uid {rec.uid} on "
                f"{rec.host}; refusing to stop it",
                EXIT_REFUSED,
            )
        ctld = next((d for d in rec.daemons if d.name == "slurmctld"), None)
        if ctld is not None and is_alive(ctld):
            # Jobs on a dead slurmd never drain; their steps are swept after the daemons stop.
            dead_node = any(d.name.startswith("slurmd-") and not is_alive(d) for d in rec.daemons)
            try:
                ids = cancel_jobs(lay, timeout=3.0 if dead_node else 20.0)
                if ids:
                    print(f"cancelled jobs: {' '.join(ids)}")
            except LocalSlurmError as e:
                log.warning("could not cancel jobs: %s", e)
        else:
            log.warning("slurmctld is not running; cannot cancel jobs by id")
        for d, outcome in stop_all(lay, rec):
            print(f"{d.name} (pid {d.pid}): {outcome}")
            if outcome == "already dead":
                log.warning("%s (pid %d) had already died", d.name, d.pid)
        print(f"cluster in {lay.root} is down; logs kept in {lay.logs}")
        return 0


# ---------------------------------------------------------------- status / env


def cmd_status(args: argparse.Namespace) -> int:
    lay = Layout(args.dir)
    rec = load_record(lay) if lay.root.exists() else None
    daemons = [
        {"name": d.name, "pid": d.pid, "alive": is_alive(d)} for d in (rec.daemons if rec else [])
    ]
    ctld_alive = any(d["name"] == "slurmctld" and d["alive"] for d in daemons)
    nodes, error = [], None
    if ctld_alive:
        try:
            nodes = sinfo_nodes(lay)
        except LocalSlurmError as e:
            error = str(e)
    healthy = bool(daemons) and all(d["alive"] for d in daemons) and error is None
    info = {
        "dir": str(lay.root),
        "slurm_conf": str(lay.conf),
        "recorded": rec is not None,
        "healthy": healthy,
        "daemons": daemons,
        "nodes": nodes,
        "error": error,
    }
    if args.output == "json":
        print(json.dumps(info, indent=2))
    else:
        print(f"dir:        {lay.root}")
        print(f"SLURM_CONF: {lay.conf}")
        if rec is None:
            print("no cluster recorded")
        for d in daemons:
            print(f"  {d['name']:<12} pid {d['pid']:<8} {'alive' if d['alive'] else 'DEAD'}")
        for n in nodes:
            print(f"  node {n['name']:<6} {n['state']:<10} cpus={n['cpus']} mem={n['memory_mb']}MB")
        if error:
            print(f"sinfo failed: {error}")
    return 0 if healthy else 1


def cmd_env(args: argparse.Namespace) -> int:
    lay = Layout(args.dir)
    if not lay.conf.exists():
        raise LocalSlurmError(f"no {lay.conf}; run `tmax-local-slurm up --dir {lay.root}`")
    print(f"export SLURM_CONF={shlex.quote(str(lay.conf))}")
    return 0


# ---------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tmax-local-slurm", description=DESCRIPTION)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)

    def with_dir(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sp.add_argument(
            "--dir",
            type=lambda s: Path(s).expanduser().absolute(),
            default=default_dir().absolute(),
            help="cluster directory (default: $TMAX_LOCAL_SLURM_DIR or ~/.tmax/local-slurm)",
        )
        return sp

    up = with_dir(sub.add_parser("up", help="start the cluster (no-op if already up)"))
    up.add_argument("--nodes", type=int, default=None, help="virtual nodes (default 3)")
    up.add_argument("--cpus", type=int, default=None, help="CPUs per node (default 2)")
    up.add_argument("--memory-mb", type=int, default=None, help="MB per node (default 2048)")
    up.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds to wait for all nodes idle (default 60)",
    )
    up.set_defaults(func=cmd_up)
    with_dir(sub.add_parser("down", help="cancel its jobs and stop its daemons")).set_defaults(
        func=cmd_down
    )
    st = with_dir(sub.add_parser("status", help="daemons and nodes"))
    st.add_argument("-o", "--output", choices=("text", "json"), default="text")
    st.set_defaults(func=cmd_status)
    with_dir(sub.add_parser("env", help="print `export SLURM_CONF=...`")).set_defaults(func=cmd_env)
    args = p.parse_args(argv)
    for k in ("nodes", "cpus", "memory_mb"):
        v = getattr(args, k, None)
        if v is not None and v < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="tmax-local-slurm: %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.func(args)
    except LocalSlurmError as e:
        log.error("%s", e)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
