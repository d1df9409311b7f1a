"""Several inference engines as the one policy the rollouts sample from, and their weights.

``EnginePool`` routes each turn to the live engine with the fewest turns in flight. An
engine whose call fails on infrastructure (``PolicyUnavailable``: its server died, its
transport broke) and that then fails its health check is taken out of rotation and handed
to ``on_lost`` (a launcher restarts it and ``add``s it back once it serves the current
weights); the turn's exception propagates, so that episode is recorded as an
infrastructure failure (masked in training), never a reward. With no live engine left, a
new turn waits up to ``wait_for_engine_s`` for one to be added (0: it fails the same way
at once).

``sync`` loads a weights folder into every live engine, each with a bounded number of
attempts; an engine that dies meanwhile is dropped as lost, one that is alive but keeps
refusing stops the run with ``WeightSyncError``: training on against an engine left on old
weights would be silent staleness. ``target`` is the newest version handed to ``sync``; an
engine joins (``add``) only once it serves at least that version. ``version`` is the
oldest version a live engine serves (each turn is stamped by the engine that sampled it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tmax.agent.policy import Completion, PolicyUnavailable
from tmax.inference.base import EngineError, InferenceEngine, WeightSyncError

log = logging.getLogger(__name__)


class EnginePool:
    """A policy over engines (``name``, ``supports_tools``, ``version``, ``complete``)."""

    def __init__(self, engines: list[InferenceEngine], *, name: str = "pool",
                 on_lost: Callable[[InferenceEngine], None] | None = None,
                 sync_attempts: int = 3, sync_backoff_s: float = 1.0,
                 wait_for_engine_s: float = 0.0):
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        self.name, self.on_lost = name, on_lost
        self.supports_tools = all(e.supports_tools for e in engines)
        self.sync_attempts, self.sync_backoff_s = sync_attempts, sync_backoff_s
        self.live: list[InferenceEngine] = list(engines)
        self.lost: list[InferenceEngine] = []
        self.in_flight: dict[int, int] = {id(e): 0 for e in engines}
        self.served: dict[int, int] = {id(e): 0 for e in engines}
        """Turns each engine answered."""
        self.target = min(e.version for e in engines)
        self.wait_for_engine_s = wait_for_engine_s
        self._added: asyncio.Event | None = None

    @property
    def version(self) -> int:
        """The oldest weights version a live engine serves (``target`` with none live)."""
        return min((e.version for e in self.live), default=self.target)

    def describe(self) -> list[dict[str, Any]]:
        """Each engine the pool has held: its name, the weights version it serves, whether
        it is in rotation, and how many turns it answered."""
        return [{"name": e.name, "version": e.version, "live": e in self.live,
                 "served": self.served.get(id(e), 0)} for e in [*self.live, *self.lost]]

    def add(self, engine: InferenceEngine) -> None:
        """Put a (restarted) engine into rotation; it must serve ``target`` or newer."""
        if engine.version < self.target:
            raise WeightSyncError(engine.name, self.target, f"it serves version "
                                  f"{engine.version}; sync it before adding it")
        self.live.append(engine)
        self.in_flight.setdefault(id(engine), 0)
        self.served.setdefault(id(engine), 0)
        if self._added is not None:
            self._added.set()

    async def _an_engine(self) -> None:
        """Wait (bounded) until an engine is live."""
        if self.live or self.wait_for_engine_s <= 0:
            return
        if self._added is None:
            self._added = asyncio.Event()
        self._added.clear()
        try:
            await asyncio.wait_for(self._added.wait(), self.wait_for_engine_s)
        except TimeoutError:
            pass

    async def complete(self, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None = None) -> Completion:
        await self._an_engine()
        if not self.live:
            raise PolicyUnavailable(self.name, "no inference engine is up "
                                    f"({len(self.lost)} lost)")
        engine = min(self.live, key=lambda e: self.in_flight[id(e)])
        self.in_flight[id(engine)] += 1
        try:
            completion = await engine.complete(messages, tools)
        except PolicyUnavailable:
            await self._check(engine)
            raise
        finally:
            self.in_flight[id(engine)] -= 1
        self.served[id(engine)] += 1
        return completion

    async def _check(self, engine: InferenceEngine) -> None:
        if engine in self.live and not await engine.health():
            self._lose(engine, "failed its health check after a failed turn")

    def _lose(self, engine: InferenceEngine, why: str) -> None:
        if engine not in self.live:
            return
        self.live.remove(engine)
        self.lost.append(engine)
        log.warning("inference engine %s out of rotation: %s", engine.name, why)
        if self.on_lost is not None:
            self.on_lost(engine)

    async def sync(self, path: str | Path, version: int) -> None:
        """Load weights ``version`` from ``path`` into every live engine (at once)."""
        await asyncio.gather(*(self._sync_one(e, path, version) for e in list(self.live)))
        self.target = max(self.target, version)
        if not self.live:
            log.warning("weights version %d: no inference engine is up to load it; a "
                        "replacement loads it before it joins", version)

    async def _sync_one(self, engine: InferenceEngine, path: str | Path, version: int) -> None:
        reason = ""
        for attempt in range(1, self.sync_attempts + 1):
            try:
                await engine.update_weights_from_path(path, version)
                return
            except (EngineError, PolicyUnavailable) as e:
                reason = str(e)
                if not await engine.health():
                    self._lose(engine, f"died during the weight sync to {version}: {reason}")
                    return
                log.warning("weight sync of %s to %d, attempt %d/%d: %s", engine.name,
                            version, attempt, self.sync_attempts, reason)
                await asyncio.sleep(self.sync_backoff_s * attempt)
        raise WeightSyncError(engine.name, version,
                              f"{self.sync_attempts} attempts failed; last: {reason}")
