"""``HttpEngine``: one client for ``vllm serve`` and ``tmax serve`` (hf-server) alike.

Chat completions go through ``OpenAIPolicy`` (its transport, retries and error sorting)
with ``logprobs: true`` and ``return_token_ids: true``; a reply without token ids is a
``PolicyError`` (a server that cannot train). Control requests (pause, resume, weights,
version) use the same retried ``OpenAIPolicy.call``; a transport failure there is
``EngineUnavailable`` (an infrastructure failure), any other refusal ``EngineError`` or,
during a weight update, ``WeightSyncError``.

Versions: the engine's version is vLLM's weight version (``GET /weight_info``), set by
``finish_weight_update {"weight_version": "N"}`` (integers, as strings on the wire).
Completions are stamped with the version this client knows when the request starts. A
weight update made through this client closes a gate first: requests that start during
the update wait for it and are stamped with the new version; ``/pause?mode=wait`` lets the
ones in flight finish on the old weights (stamped old). Call ``refresh_version()`` when
another process may have updated the server.

Filesystem update, vLLM's four-phase weight-transfer protocol with the shared-disk
payload: ``/pause?mode=wait``, ``/start_weight_update``, ``/update_weights
{"update_info": {"path": ABS_DIR}}``, ``/finish_weight_update {"weight_version": "N"}``,
check ``/weight_info``, ``/resume`` (always, even after a failure). The NCCL variant
(``update_weights_from_broadcast``) posts ``/update_weights`` with the payload of
``tmax.inference.vllm.nccl_update_info`` while the trainer broadcasts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from tmax.agent.policies.openai import OpenAIPolicy
from tmax.agent.policy import Completion, PolicyError, PolicyUnavailable
from tmax.inference.base import (
    EngineError,
    EngineUnavailable,
    WeightSyncError,
    check_weights_dir,
)


class HttpEngine:
    """An OpenAI-compatible server with vLLM's token-id, pause and weight routes."""

    def __init__(self, base_url: str, model: str, *, name: str | None = None,
                 temperature: float = 1.0, max_tokens: int | None = None,
                 concurrency: int = 64, timeout_s: float = 600.0, max_retries: int = 3,
                 backoff_s: float = 0.5, sync_timeout_s: float = 600.0,
                 supports_tools: bool = False, pause_mode: str = "wait"):
        root = base_url.rstrip("/")
        self.root = root.removesuffix("/v1")
        self.name = name or f"http:{model}@{self.root}"
        self.supports_tools = supports_tools
        self.sync_timeout_s, self.pause_mode = sync_timeout_s, pause_mode
        self.policy = OpenAIPolicy(
            self.root + "/v1", model, concurrency=concurrency, timeout_s=timeout_s,
            max_retries=max_retries, backoff_s=backoff_s, max_backoff_s=10.0,
            temperature=temperature, max_tokens=max_tokens, supports_tools=supports_tools,
            return_tokens=True, name=self.name)
        self._version = 0
        self._open: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def version(self) -> int:
        return self._version

    def _gate(self) -> asyncio.Event:
        loop = asyncio.get_running_loop()
        if self._open is None or self._loop is not loop:
            self._open, self._loop = asyncio.Event(), loop
            self._open.set()
        return self._open

    async def complete(self, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None = None) -> Completion:
        await self._gate().wait()
        version = self._version
        completion = await self.policy.complete(messages, tools)
        if completion.completion_ids is None or completion.logprobs is None:
            raise PolicyError(self.name, "the reply has no token ids or logprobs (the server "
                              "must support return_token_ids: vLLM >= 0.10.2 or tmax serve)")
        completion.policy_version = version
        return completion

    async def health(self) -> bool:
        try:
            async with httpx.AsyncClient(timeout=5.0) as client:
                response = await client.get(self.root + "/health")
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def _control(self, route: str, body: dict[str, Any] | None = None, *,
                       method: str = "POST", params: dict[str, str] | None = None
                       ) -> dict[str, Any]:
        try:
            return await self.policy.call(self.root + route, body, method=method,
                                          params=params)
        except PolicyUnavailable as e:
            raise EngineUnavailable(self.name, f"{route}: {e.reason}") from None
        except PolicyError as e:
            raise EngineError(self.name, f"{route}: {e.reason}") from None

    async def refresh_version(self) -> int:
        """Read the server's version (``GET /weight_info``) into ``version``."""
        data = await self._control("/weight_info", method="GET")
        try:
            self._version = int(str(data["weight_version"]))
        except (KeyError, ValueError):
            raise EngineError(self.name, f"/weight_info gave no integer weight_version: "
                              f"{str(data)[:200]}") from None
        return self._version

    async def pause(self) -> None:
        await self._control("/pause", params={"mode": self.pause_mode})

    async def resume(self) -> None:
        await self._control("/resume")

    async def is_paused(self) -> bool:
        return bool((await self._control("/is_paused", method="GET")).get("is_paused"))

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """``/init_weight_transfer_engine`` (once, before the first NCCL update)."""
        await self._control("/init_weight_transfer_engine", {"init_info": init_info})

    async def update_weights_from_path(self, path: str | Path, version: int) -> None:
        folder = check_weights_dir(path, engine=self.name, version=version)

        async def load() -> None:
            await self._control("/update_weights", {"update_info": {"path": str(folder)}})

        await self._sync(version, load)

    async def update_weights_from_broadcast(self, update_info: dict[str, Any], version: int,
                                            broadcast: Callable[[], Awaitable[None]]) -> None:
        """An NCCL update: ``/update_weights`` with ``update_info`` (see
        ``tmax.inference.vllm.nccl_update_info``) while ``broadcast()`` sends the tensors
        from the trainer (both must run at once: the receivers wait in the collective)."""
        async def load() -> None:
            await asyncio.gather(
                self._control("/update_weights", {"update_info": update_info}), broadcast())

        await self._sync(version, load)

    async def _sync(self, version: int, load: Callable[[], Awaitable[None]]) -> None:
        gate = self._gate()
        gate.clear()
        try:
            await asyncio.wait_for(self._sync_steps(version, load), self.sync_timeout_s)
        except TimeoutError:
            raise WeightSyncError(self.name, version,
                                  f"timed out after {self.sync_timeout_s} s") from None
        except EngineError as e:
            raise WeightSyncError(self.name, version, e.reason) from None
        except PolicyUnavailable as e:
            raise WeightSyncError(self.name, version, e.reason) from None
        finally:
            gate.set()

    async def _sync_steps(self, version: int, load: Callable[[], Awaitable[None]]) -> None:
        await self.pause()
        try:
            await self._control("/start_weight_update")
            await load()
            await self._control("/finish_weight_update", {"weight_version": str(version)})
            served = await self.refresh_version()
            if served != version:
                raise EngineError(self.name, f"the server reports version {served} after "
                                  f"the update to {version}")
        finally:
            try:
                await self.resume()
            except (EngineError, PolicyUnavailable):
                pass  # the update's own error (or the dead server) is the one to report

    async def aclose(self) -> None:
        await self.policy.aclose()
