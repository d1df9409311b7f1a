"""The fleet controller: one asyncio daemon per fleet, owning lifecycle (nodes, leases).

It never runs a command in a sandbox: workers serve exec and files to clients directly.
What it owns:

- **Nodes**: workers register (id, address, slots = CPUs, memory, provider job) and
  heartbeat every ``heartbeat_s``; one silent for ``lost_after_s`` is *lost*: its leases
  end with ``NodeLost`` (recorded, so the holder's next renew or exec raises it at once)
  and its job is cancelled so the scaler replaces it.
- **Leases**: ``acquire`` queues FIFO per client, clients served round-robin, until a
  worker slot fits (best fit, so idle nodes can drain), asks that worker to start the
  sandbox and answers with the grant; ``CapacityTimeout`` after ``wait_s``. Expiry = last
  renewal + ttl; a renew, or a worker heartbeat reporting an exec or a running command
  (which pins the lease), renews. An expired lease's sandbox is destroyed via its worker
  and the reason recorded. Release is idempotent; a repeated acquire id answers with the
  lease it already got.
- **Scaling** (``Scaler``): desired workers = ceil((queued + held) CPUs / cpus_per_node)
  within [min_nodes, max_nodes]; the provider submits the difference, a few per tick;
  workers idle past ``idle_s`` are released; lost ones are cancelled and so replaced. One
  batched provider poll per interval, backing off while nothing changes.
- **State dir**: ``controller.json`` (address, token; 0600, atomic), ``journal.jsonl``
  (append-only, fsync'd by group commit, rewritten as a snapshot at start and every
  ``COMPACT_AFTER`` events), ``fleet.json`` (the resolved config, read by workers),
  ``logs/``. A restarted controller rebuilds nodes, leases and jobs from the journal, keeps
  its token and tries its old port; renewals are not journaled, so recovered leases count
  as renewed at recovery (downtime never expires a lease) and recovered nodes get
  ``lost_after_s`` to heartbeat again.

The modules, in the order they depend on each other: ``journal`` (typed events, the file,
one ``replay``), ``state`` (records and the registry), ``placement`` (queues and pure
placement decisions), ``monitor`` (liveness decisions, status), ``pool`` (worker
connections), ``scaler`` (worker jobs, through the ``FleetView`` protocol), ``leasing``
(the ``LeaseDesk``: acquire, grant, renew, release, end) and ``core`` (the ``Controller``:
request handling and wiring).
"""

from __future__ import annotations

from sandfleet.config import CONFIG_FILE, fleet_config_of
from sandfleet.controller.core import (
    COMPACT_AFTER,
    LOCK_FILE,
    Controller,
    advertised_host,
    controller_alive,
    serve_forever,
)
from sandfleet.controller.journal import JOURNAL, Journal, replay
from sandfleet.controller.placement import desired_nodes
from sandfleet.controller.scaler import FleetView, Scaler
from sandfleet.controller.state import ENDED_KEEP, RECENT_FAILURES, Job, Lease, Node, Waiter

__all__ = ["COMPACT_AFTER", "CONFIG_FILE", "ENDED_KEEP", "JOURNAL", "LOCK_FILE",
           "RECENT_FAILURES", "Controller", "FleetView", "Job", "Journal", "Lease", "Node",
           "Scaler", "Waiter", "advertised_host", "controller_alive", "desired_nodes",
           "fleet_config_of", "replay", "serve_forever"]
