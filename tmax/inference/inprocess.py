"""``InProcessEngine``: HFPolicy (transformers in this process) behind the engine seam.

For the smallest runs: no server, no HTTP. ``pause`` closes a gate that new requests wait
at and waits for the ones in flight; ``update_weights_from_path`` reads the safetensors
folder in a worker thread and swaps the weights under HFPolicy's lock (a batch in flight
ends on the weights it started with).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tmax.agent.policy import Completion
from tmax.inference.base import full_state, read_weights


class InProcessEngine:
    def __init__(self, policy: Any, *, name: str | None = None):
        self.policy = policy
        self.name = name or policy.name
        self.supports_tools = False
        self._open: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._running = 0

    @classmethod
    def from_pretrained(cls, path: str | Path, **options: Any) -> InProcessEngine:
        from tmax.agent.policies.hf import HFPolicy
        return cls(HFPolicy.from_pretrained(path, **options))

    @property
    def version(self) -> int:
        return int(self.policy.version)

    def _events(self) -> tuple[asyncio.Event, asyncio.Event]:
        if self._open is None or self._idle is None:
            self._open, self._idle = asyncio.Event(), asyncio.Event()
            self._open.set()
            self._idle.set()
        return self._open, self._idle

    async def complete(self, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None = None) -> Completion:
        gate, idle = self._events()
        while not gate.is_set():
            await gate.wait()
        self._running += 1
        idle.clear()
        try:
            return await self.policy.complete(messages, tools)
        finally:
            self._running -= 1
            if self._running == 0:
                idle.set()

    async def health(self) -> bool:
        return True

    async def pause(self) -> None:
        gate, idle = self._events()
        gate.clear()
        await idle.wait()

    async def resume(self) -> None:
        self._events()[0].set()

    async def update_weights_from_path(self, path: str | Path, version: int) -> None:
        state = await asyncio.to_thread(read_weights, path, engine=self.name, version=version)
        full = full_state(self.policy.model, state, engine=self.name, version=version)
        await asyncio.to_thread(self.policy.update_weights, full, version)

    async def aclose(self) -> None:
        return None
