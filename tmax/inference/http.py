"""``HttpEngine``: one client for ``vllm serve`` and ``tmax serve`` (hf-server) alike.

Chat completions go through ``OpenAIPolicy`` (its transport, retries and error sorting)
with ``logprobs: true`` and ``return_token_ids: true``; a reply without token ids is a
``PolicyError`` (a server that cannot train). Control requests (pause, resume, weights,
version) use the same retried ``OpenAIPolicy.call``; a transport failure there is
``EngineUnavailable`` (an infrastructure failure), any other refusal ``EngineError`` or,
during a weight update, ``WeightSyncError``.

Versions: the engine's version is vLLM's weight version (``GET /weight_info``), set by
``/update_weight_version {"new_version": "N"}`` (integers, as strings on the wire). A
server that was never updated reports vLLM's initial ``"default"``: the weights it was
started from, version 0. Completions are stamped with the version this client knows when
the request starts. A weight update made through this client closes a gate first:
requests that start during the update wait for it and are stamped with the new version;
``/pause?mode=wait`` lets the ones in flight finish on the old weights (stamped old). Call
``refresh_version()`` when another process may have updated the server.

A request that reaches the server while it is paused is held there (vLLM <= 0.32,
hf-server) or refused with HTTP 503 naming the pause (vLLM >= 0.33): then this client
waits until ``GET /is_paused`` says false and sends it again (bounded by
``sync_timeout_s``); a paused server is never an infrastructure failure.

Folder update (``update_weights_from_path``), through vLLM's dev routes:
``/pause?mode=wait``, ``/collective_rpc {"method": "reload_weights", "kwargs":
{"weights_path": ABS_DIR}}`` (every worker reloads the safetensors folder in place),
``/reset_prefix_cache`` (a reload keeps the KV blocks of the old weights),
``/update_weight_version {"new_version": "N"}``, check ``/weight_info``, ``/resume``
(always, even after a failure). The NCCL variant (``update_weights_from_broadcast``) is
vLLM's weight-transfer protocol: ``/start_weight_update``, ``/update_weights`` with the
payload of ``tmax.inference.vllm.nccl_update_info`` while the trainer broadcasts,
``/finish_weight_update {"weight_version": "N"}``.
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
        while True:
            await self._gate().wait()
            version = self._version
            try:
                completion = await self.policy.complete(messages, tools)
                break
            except PolicyUnavailable as e:
                if not await self._refused_while_paused(e):
                    raise
                await self._wait_resumed(e)
        if completion.completion_ids is None or completion.logprobs is None:
            raise PolicyError(self.name, "the reply has no token ids or logprobs (the server "
                              "must support return_token_ids: vLLM >= 0.10.2 or tmax serve)")
        completion.policy_version = version
        return completion

    async def _refused_while_paused(self, error: PolicyUnavailable) -> bool:
        """Whether ``error`` is the server refusing a request because it is paused (vLLM
        >= 0.33: HTTP 503 ``engine_paused``), not a failure."""
        if "HTTP 503" not in error.reason:
            return False
        if "pause" in error.reason.lower():
            return True
        try:
            return await self.is_paused()
        except (EngineError, PolicyUnavailable):
            return False

    async def _wait_resumed(self, error: PolicyUnavailable) -> None:
        """Wait until the server (or this client's own sync) is no longer paused."""
        deadline = asyncio.get_running_loop().time() + self.sync_timeout_s
        delay = 0.05
        while True:
            await self._gate().wait()
            try:
                if not await self.is_paused():
                    return
            except EngineError:
                return  # a server without /is_paused: just send it again
            if asyncio.get_running_loop().time() > deadline:
                raise PolicyUnavailable(self.name, f"still paused after "
                                        f"{self.sync_timeout_s:.0f} s: {error.reason}")
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)

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
        self._version = parse_version(data.get("weight_version"), self.name)
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
        """Reload the weights folder ``path`` in place as ``version`` (see the module)."""
        folder = check_weights_dir(path, engine=self.name, version=version)

        async def load() -> None:
            await self._control("/collective_rpc", {
                "method": "reload_weights", "kwargs": {"weights_path": str(folder)}})
            reset = await self._control("/reset_prefix_cache")
            if reset.get("success") is False:
                raise EngineError(self.name, "/reset_prefix_cache failed: the old weights' "
                                  "cached prefixes would be served")
            await self._control("/update_weight_version", {"new_version": str(version)})

        await self._sync(version, load)

    async def update_weights_from_broadcast(self, update_info: dict[str, Any], version: int,
                                            broadcast: Callable[[], Awaitable[None]]) -> None:
        """An NCCL update: ``/update_weights`` with ``update_info`` (see
        ``tmax.inference.vllm.nccl_update_info``) while ``broadcast()`` sends the tensors
        from the trainer (both must run at once: the receivers wait in the collective)."""
        async def load() -> None:
            await self._control("/start_weight_update")
            await asyncio.gather(
                self._control("/update_weights", {"update_info": update_info}), broadcast())
            await self._control("/finish_weight_update", {"weight_version": str(version)})

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
            await load()
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


INITIAL_VERSION = "default"
"""vLLM's weight version before any update (``EngineCore._weight_version``)."""


def parse_version(value: Any, engine: str = "?") -> int:
    """A server's ``weight_version`` as TMax's integer version: vLLM's initial
    ``"default"`` is the weights the server started from, version 0."""
    if value == INITIAL_VERSION:
        return 0
    try:
        return int(str(value))
    except ValueError:
        raise EngineError(engine, f"/weight_info gave weight_version {value!r}: neither an "
                          f"integer nor vLLM's initial {INITIAL_VERSION!r}") from None
