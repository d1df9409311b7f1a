"""The orchestrator's side of the NCCL weight sync (``vllm.weight_transfer: nccl``); the
trainer's side and the file protocol are ``tmax.train.weight_sync``.

``NcclCoordinator`` owns the transfer group's membership: ``build`` asks the trainer for a
new group over the given servers (``group.json``, generation G+1), waits for its endpoint
and posts every server's ``/init_weight_transfer_engine`` (their ranks laid out by
``nccl_group``) while the trainer's rank 0 opens it. ``sync`` serves one offered version
to every member at once: each server pauses, starts the update and posts
``/update_weights`` (``HttpEngine.update_weights_from_broadcast``), the trainer is told to
go, and once it has sent, each server finishes the update as that version and resumes.
No folder path is ever posted. A replaced server means a new group (``replace``): the
trainer joins it at its next publish, and the newcomer enters the pool once it serves
the version the others do. A restarted trainer (a new ``hello.json``) gets a new group
too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tmax.inference.base import WeightSyncError
from tmax.inference.nccl import (
    PACKED_BUFFER_SIZE_BYTES,
    PACKED_NUM_BUFFERS,
    nccl_group,
)
from tmax.train.weight_sync import SyncFolder, WeightSyncTimeout

log = logging.getLogger(__name__)


class NcclCoordinator:
    """The orchestrator's end of the NCCL weight sync for one run."""

    def __init__(self, run_dir: str | Path, *, gpus_per_server: int, timeout_s: float,
                 trainer_alive: Callable[[], bool]):
        self.files = SyncFolder(run_dir)
        self.gpus, self.timeout_s, self.trainer_alive = gpus_per_server, timeout_s, \
            trainer_alive
        previous = self.files.group()
        self.generation = int(previous["generation"]) if previous else 0
        self.members: list[Any] = []
        self.pending: list[Any] = []
        """Members not yet in the pool (replacements waiting for their first version)."""
        self.handled: set[tuple[int, int]] = set()
        self.trainer_id = ""
        """The trainer process the current group was made for (its hello)."""

    async def _wait(self, name: str) -> dict[str, Any]:
        return await asyncio.to_thread(self.files.wait, name, timeout_s=self.timeout_s,
                                       alive=self.trainer_alive, poll_s=0.2)

    async def build(self, engines: list[Any]) -> None:
        """A new transfer group of the trainer's rank 0 and every worker of ``engines``."""
        # from here on an offer made for an older group is refused (its members changed:
        # a broadcast over it would wait for a server that is gone), before any await
        self.generation += 1
        g = self.generation
        hello = await self._wait("hello.json")
        self.trainer_id = str(hello["id"])
        world = 1 + self.gpus * len(engines)
        self.members = list(engines)
        self.files.write("group.json", {
            "generation": g, "trainer": self.trainer_id, "world_size": world,
            "servers": [e.name for e in engines],
            "packed_buffer_size_bytes": PACKED_BUFFER_SIZE_BYTES,
            "packed_num_buffers": PACKED_NUM_BUFFERS})
        log.info("weight sync: NCCL group %d over %d server(s), %d ranks; waiting for the "
                 "trainer's endpoint", g, len(engines), world)
        endpoint = await self._wait(f"endpoint-{g}.json")
        infos = nccl_group([self.gpus] * len(engines), endpoint["master_address"],
                           int(endpoint["master_port"]),
                           packed_buffer_size_bytes=PACKED_BUFFER_SIZE_BYTES,
                           packed_num_buffers=PACKED_NUM_BUFFERS)
        await asyncio.gather(*(e.init_weight_transfer(info)
                               for e, info in zip(engines, infos, strict=True)))
        log.info("weight sync: NCCL group %d is up", g)

    async def replace(self, pool: Any, engine: Any) -> None:
        """``engine`` replaces a lost server: a new group over the live ones and it."""
        self.pending.append(engine)
        await self.build([*pool.live, *self.pending])

    async def _go_and_wait(self, version: int) -> None:
        self.files.write(f"go-{version:08d}.json", {"version": version,
                                                    "generation": self.generation})
        t0 = time.monotonic()
        try:
            await self._wait(f"sent-{version:08d}.json")
        except WeightSyncTimeout as e:
            raise WeightSyncError("trainer", version, str(e)) from None
        log.info("weight sync: version %d broadcast in %.1f s", version,
                 time.monotonic() - t0)

    async def sync(self, pool: Any, offer: dict[str, Any]) -> bool:
        """Serve ``offer`` (``offer-*.json``) to every member; False when it was made for
        another group (the trainer is told to join the current one and offer again)."""
        version, generation = int(offer["version"]), int(offer["generation"])
        if (version, generation) in self.handled:
            return False
        self.handled.add((version, generation))
        if generation != self.generation:
            self.files.write(f"go-{version:08d}.json", {"version": version,
                                                        "generation": self.generation})
            return False
        members = [e for e in self.members if e in pool.live or e in self.pending]
        sent = asyncio.ensure_future(self._go_and_wait(version))

        async def broadcast() -> None:
            await asyncio.shield(sent)

        results = await asyncio.gather(
            *(e.update_weights_from_broadcast(offer["update_info"], version, broadcast)
              for e in members), return_exceptions=True)
        if not sent.done():
            sent.cancel()
        for engine, result in zip(members, results, strict=True):
            if isinstance(result, BaseException):
                if not await engine.health():
                    pool._lose(engine, f"died during the NCCL sync to {version}: {result}")
                    continue
                raise WeightSyncError(engine.name, version, f"NCCL update failed: {result}")
        pool.target = version  # the trainer's weights (older after a trainer restart)
        for engine in list(self.pending):
            if engine.version >= pool.target:
                self.pending.remove(engine)
                pool.add(engine)
                log.warning("inference: %s joined after NCCL version %d", engine.name,
                            version)
        return True

    def latest_offer(self) -> dict[str, Any] | None:
        return self.files.latest_offer()

    # ---- the orchestrator's weights channel (processes.orchestrate)

    async def start(self, pool: Any) -> int:
        """The group over the pool's servers, and the trainer's first version in them."""
        await self.build(list(pool.live))
        while True:
            offer = await asyncio.to_thread(self.files.wait_offer, self.timeout_s,
                                            self.trainer_alive)
            if await self.sync(pool, offer):
                return int(offer["version"])

    async def follow(self, pool: Any) -> None:
        """A new group for a restarted trainer; serve the trainer's newest offer if new."""
        hello = self.files.read("hello.json")
        if hello is not None and hello.get("id") != self.trainer_id:
            log.warning("weight sync: the trainer restarted; a new NCCL group for it")
            await self.build([e for e in self.members if e in pool.live or e in self.pending])
        offer = self.latest_offer()
        if offer is not None and (int(offer["version"]), int(offer["generation"])) \
                not in self.handled:
            await self.sync(pool, offer)
