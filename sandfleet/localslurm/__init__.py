"""Start, stop and inspect a throwaway Slurm cluster on this one host (the console
script ``tmax-local-slurm``; ``python -m sandfleet.localslurm``; ``bin/tmax-local-slurm``).

    tmax-local-slurm up     [--dir DIR] [--nodes N] [--cpus C] [--memory-mb M] [--timeout S]
    tmax-local-slurm down   [--dir DIR]
    tmax-local-slurm status [--dir DIR] [-o text|json]
    tmax-local-slurm env    [--dir DIR]            # eval "$(tmax-local-slurm env)"

`up` starts, each in its own session (process group) and all under DIR:

    munged      own key, socket, pid, seed and log file        DIR/munge/, DIR/log/munged.log
    slurmctld   ClusterName=tmaxlocal, free TCP port          DIR/state/, DIR/log/slurmctld.log
    slurmd x N  virtual nodes n1..nN (`slurmd -N nI`), own port  DIR/spool/nI/, DIR/log/slurmd-nI.log

The config is DIR/etc/slurm.conf; clients only need SLURM_CONF pointing at it (it names our
munge socket in AuthInfo, so they never talk to the system munged). `up` waits until `sinfo`
shows every node idle, then prints `export SLURM_CONF=...`.

Ownership: DIR/cluster.json records the owner uid, the host and, per daemon, its pid and its
start time (field 22 of /proc/<pid>/stat), so a recycled pid is never taken for ours.
`up` and `down` only ever signal processes whose pid AND start time match that record
(plus, for a daemon that already died, the leftovers of its own process group).

`up` on DIR:
  - nothing there, or a record whose daemons are all dead (reboot, crash): fresh start;
  - a healthy cluster recorded there: no-op, exit 0 (if --nodes/--cpus/--memory-mb are given
    and differ from the running cluster: exit 2, run `down` first);
  - a record with some daemons alive and some dead: exit 3 and asks you to run `down` first
    (it does NOT do down+up by itself: a half-dead cluster may hold jobs you want to look at);
  - a live process named by a pid file under DIR that the record does not list, a record of
    another user or host, or DIR owned by another user: refuses, exit 2, naming pid and DIR.
A failed `up` stops whatever it started and leaves the logs.

`down` cancels the jobs of THAT cluster by id (squeue, then scancel <ids>), stops the
recorded daemons (SIGTERM to the group, SIGKILL after a grace period), reports daemons that
had already died, keeps the logs and removes the record. Exit 0 unless it cannot stop one.

munged runs with --force: it insists on o+x for every ancestor of its socket directory, and
DIR often sits under a 0700 directory (/root, pytest's tmp dirs); with --force that check is a
warning. No other munged can be serving DIR's socket: `up` holds DIR's lock, has checked the
pid files, and removes the stale socket itself.

The state save dir is cleared on every fresh `up` (slurmctld -c): jobs never come back from a
previous cluster.

Modules: ``procs`` (daemon identity: pid and start time, signalling, commands),
``cluster`` (the layout under DIR, the record, slurm.conf, starting and stopping),
``commands`` (up, down, status, env and the argument parser).
"""

from __future__ import annotations

from sandfleet.localslurm.commands import main

__all__ = ["main"]
