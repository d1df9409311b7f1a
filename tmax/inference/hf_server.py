"""hf-server (``tmax serve MODEL_DIR``): vLLM's HTTP subset over a transformers model.

The CPU (or one-GPU) stand-in for ``vllm serve``: the same routes, request fields and
response shapes as vLLM (>= 0.29, the four-phase weight-transfer routes of its dev mode),
so one client (``tmax.inference.http.HttpEngine``) drives both.

Routes (vLLM's):

- ``POST /v1/chat/completions``: ``messages``, ``model``, ``temperature``, ``max_tokens`` /
  ``max_completion_tokens``, ``logprobs`` (bool), ``top_logprobs`` (0 only),
  ``return_token_ids`` (bool), ``n`` (1 only), no streaming. The answer is vLLM's
  ``chat.completion``: ``choices[0].message.content``, ``finish_reason``,
  ``choices[0].logprobs.content[i].{token, logprob, bytes, top_logprobs}`` and
  ``choices[0].token_ids`` when asked, ``prompt_token_ids`` at the top level, ``usage``.
- ``GET /v1/models``, ``GET /health`` (200, empty body).
- ``POST /pause?mode=wait|keep|abort``, ``POST /resume``, ``GET /is_paused``: while paused,
  new chat requests wait (they are not refused) and are served after ``/resume``. Every
  mode lets the batch in flight finish (HFPolicy's generation loop cannot be cut short):
  ``/pause`` answers once no generation runs, as vLLM's ``mode=wait`` does.
- ``POST /init_weight_transfer_engine`` ``{"init_info": {}}``, ``POST /start_weight_update``,
  ``POST /update_weights`` ``{"update_info": {"path": "/abs/folder"}}`` (a folder of HF
  safetensors: hf-server's own payload for the four-phase routes; vLLM has no such
  backend and reloads folders through ``/collective_rpc``), ``POST /finish_weight_update``
  ``{"weight_version": "7"}``: the new weights replace the old ones at ``finish``, under
  HFPolicy's lock, so a batch in flight ends on the weights it started with.
- ``POST /collective_rpc`` ``{"method": "reload_weights", "kwargs": {"weights_path":
  "/abs/folder"}}``: the folder reload TMax uses with vLLM (only this method; others are
  refused with 400, as is a folder that does not fit the model: vLLM answers 500 there).
  The weights are replaced at once under HFPolicy's lock; the version is unchanged.
  ``POST /reset_prefix_cache`` -> ``{"success": true}`` (no prefix cache here).
- ``GET /weight_info`` -> ``{"weight_version": "7"}``, ``POST /update_weight_version``
  ``{"new_version": "7"}``: the version. It is vLLM's own weight-version string; here it
  must be an integer (TMax stamps rollouts with integer versions). Until it is first set
  it reads ``"default"``, as vLLM's does (TMax reads that as version 0).

Added (not vLLM): ``GET /tmax/stats``: ``batch_sizes`` (how many batches of each size ran:
batching is visible), ``requests``, ``weight_version``, ``is_paused``.

Sampling is HFPolicy's (``tmax.agent.policies.hf``): concurrent requests wait together
and run as one left-padded batch in a worker thread; the event loop never blocks. The
temperature and the longest completion are the server's (``--temperature``,
``--max-tokens``): a request asking for another temperature is refused with 400; a
``max_tokens`` below the server's cuts the sampled completion (the same distribution as
stopping early).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web

from tmax.agent.policy import ContextLimit, PolicyError, PolicyUnavailable
from tmax.inference.base import WeightSyncError, full_state, read_weights

log = logging.getLogger(__name__)
PAUSE_MODES = ("abort", "wait", "keep")


class ModelDirError(ValueError):
    """MODEL_DIR is not a transformers model folder."""


def load_policy(model_dir: str | Path, *, device: str | None = None, **options: Any) -> Any:
    """HFPolicy over the local model folder ``model_dir`` (ModelDirError naming the folder
    when it holds no model)."""
    from tmax.agent.policies.hf import HFPolicy

    folder = Path(model_dir)
    if not folder.is_dir():
        raise ModelDirError(f"{folder}: not a folder (expected a transformers model folder)")
    if not (folder / "config.json").is_file():
        raise ModelDirError(f"{folder}: not a transformers model folder (no config.json)")
    try:
        return HFPolicy.from_pretrained(folder, device=device, **options)
    except (OSError, ValueError, KeyError) as e:
        raise ModelDirError(f"{folder}: cannot load the model: {e}") from None


def _error(status: int, message: str, kind: str = "BadRequestError") -> web.Response:
    """vLLM's error body."""
    return web.json_response({"error": {"message": message, "type": kind, "param": None,
                                         "code": status}}, status=status)


class HFServer:
    """The aiohttp app over one HFPolicy. ``start()`` serves it from a background thread
    (tests, benchmarks); ``serve()`` runs it on the caller's loop (``tmax serve``)."""

    def __init__(self, policy: Any, *, model_name: str, host: str = "127.0.0.1",
                 port: int = 0, version: int = 0):
        self.policy, self.model_name, self.host, self.port = policy, model_name, host, port
        self.policy.version = version
        self._version_set = version != 0  # until then /weight_info says "default"
        self.requests = 0
        self._running = 0
        self._resumed: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._session = False
        self._staged: dict[str, Any] | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failed: BaseException | None = None

    @property
    def url(self) -> str:
        """The base URL, ending in /v1."""
        return f"http://{self.host}:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.add_routes([
            web.post("/v1/chat/completions", self.chat), web.get("/v1/models", self.models),
            web.get("/health", self.health), web.post("/pause", self.pause),
            web.post("/resume", self.resume), web.get("/is_paused", self.is_paused),
            web.post("/init_weight_transfer_engine", self.init_transfer),
            web.post("/start_weight_update", self.start_update),
            web.post("/update_weights", self.update_weights),
            web.post("/finish_weight_update", self.finish_update),
            web.post("/update_weight_version", self.set_version),
            web.post("/collective_rpc", self.collective_rpc),
            web.post("/reset_prefix_cache", self.reset_prefix_cache),
            web.get("/weight_info", self.weight_info), web.get("/tmax/stats", self.stats)])
        return app

    # -- lifecycle ---------------------------------------------------------------------

    async def serve(self, ready: Any = None) -> None:
        """Serve until ``stop_serving()`` (or cancellation); ``ready(url)`` once bound."""
        self._loop = asyncio.get_running_loop()
        self._resumed, self._idle, self._stop = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self._resumed.set()
        self._idle.set()
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
            self.port = runner.addresses[0][1]
            log.info("hf-server %s on %s", self.model_name, self.url)
            if ready is not None:
                ready(self.url)
            await self._stop.wait()
        finally:
            await runner.cleanup()

    def stop_serving(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    def start(self, timeout_s: float = 30.0) -> HFServer:
        """Serve from a background thread; returns once the port is bound."""
        def run() -> None:
            loop = asyncio.new_event_loop()
            try:
                loop.run_until_complete(self.serve(lambda _: self._ready.set()))
            except BaseException as e:  # noqa: BLE001 - reported to start()
                self._failed = e
                self._ready.set()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="hf-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._failed is not None:
            raise RuntimeError(f"hf-server did not start: {self._failed!r}")
        return self

    def stop(self) -> None:
        self.stop_serving()
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None

    def __enter__(self) -> HFServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- generation --------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "request body is not JSON")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return _error(400, "expected a JSON object with a 'messages' list")
        problem = self._unsupported(body)
        if problem:
            return _error(400, problem)
        if body.get("model") not in (None, self.model_name):
            return _error(404, f"The model `{body.get('model')}` does not exist.",
                          "NotFoundError")
        assert self._resumed is not None and self._idle is not None
        self.requests += 1
        while not self._resumed.is_set():  # paused: wait (vLLM holds new requests too)
            await self._resumed.wait()
        self._running += 1
        self._idle.clear()
        try:
            completion = await self.policy.complete(body["messages"], body.get("tools"))
        except ContextLimit as e:
            return _error(400, f"This model's maximum context length is "
                          f"{self.policy.max_context} tokens: {e.reason}")
        except PolicyError as e:
            return _error(400, e.reason)
        except PolicyUnavailable as e:
            return _error(500, e.reason, "InternalServerError")
        finally:
            self._running -= 1
            if self._running == 0:
                self._idle.set()
        return web.json_response(self._response(body, completion))

    def _unsupported(self, body: dict[str, Any]) -> str | None:
        if body.get("stream"):
            return "hf-server does not stream; send stream: false"
        if body.get("n") not in (None, 1):
            return "hf-server samples one choice per request (n = 1)"
        if body.get("top_logprobs"):
            return "hf-server returns the sampled token's logprob only (top_logprobs = 0)"
        temperature = body.get("temperature")
        if temperature is not None and not isinstance(temperature, int | float):
            return "temperature must be a number"
        if temperature is not None and float(temperature) != self.policy.temperature:
            return (f"hf-server samples at temperature {self.policy.temperature} (its "
                    f"--temperature); the request asks for {temperature}")
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            return "max_tokens must be a positive integer"
        return None

    def _response(self, body: dict[str, Any], completion: Any) -> dict[str, Any]:
        ids, logprobs = list(completion.completion_ids), list(completion.logprobs)
        finish, content = completion.finish_reason, completion.content
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is not None and len(ids) > limit:
            ids, logprobs, finish = ids[:limit], logprobs[:limit], "length"
            content = self.policy.tokenizer.decode(ids, skip_special_tokens=True,
                                                   clean_up_tokenization_spaces=False)
        choice: dict[str, Any] = {
            "index": 0, "message": {"role": "assistant", "content": content,
                                    "tool_calls": []},
            "logprobs": None, "finish_reason": finish, "stop_reason": None}
        if body.get("logprobs"):
            tokenizer = self.policy.tokenizer
            entries = []
            for t, lp in zip(ids, logprobs):
                text = tokenizer.decode([t], clean_up_tokenization_spaces=False)
                entries.append({"token": text, "logprob": lp,
                                "bytes": list(text.encode()), "top_logprobs": []})
            choice["logprobs"] = {"content": entries}
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
        prompt = completion.prompt_ids
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": self.model_name, "choices": [choice],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                      "total_tokens": len(prompt) + len(ids)},
            "prompt_logprobs": None,
            "prompt_token_ids": prompt if body.get("return_token_ids") else None}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "tmax", "root": self.model_name, "parent": None,
            "max_model_len": self.policy.max_context, "permission": []}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    # -- pause / resume ----------------------------------------------------------------

    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return _error(400, f"mode must be one of {', '.join(PAUSE_MODES)}")
        assert self._resumed is not None and self._idle is not None
        self._resumed.clear()
        await self._idle.wait()
        return web.json_response({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        assert self._resumed is not None
        self._resumed.set()
        return web.json_response({"status": "resumed"})

    async def is_paused(self, request: web.Request) -> web.Response:
        assert self._resumed is not None
        return web.json_response({"is_paused": not self._resumed.is_set()})

    # -- weights -----------------------------------------------------------------------

    async def init_transfer(self, request: web.Request) -> web.Response:
        body = await _json(request)
        if not isinstance(body.get("init_info"), dict):
            return _error(400, "Missing 'init_info' in request body")
        return web.json_response({"message": "Weight transfer initialized"})

    async def start_update(self, request: web.Request) -> web.Response:
        if self._session:  # a client gave up mid-update (vLLM refuses; a retry must work)
            log.warning("hf-server %s: a weight update was left open; starting over",
                        self.model_name)
        self._session, self._staged = True, None
        return web.json_response({"message": "Weight update started"})

    async def update_weights(self, request: web.Request) -> web.Response:
        body = await _json(request)
        info = body.get("update_info")
        if not isinstance(info, dict):
            return _error(400, "Missing 'update_info' in request body")
        path = info.get("path")
        if not self._session:
            return _error(400, "start_weight_update must be called before loading a "
                          "checkpoint")
        try:
            state = await asyncio.to_thread(_read_checkpoint, path, self.model_name)
            self._staged = full_state(self.policy.model, state, engine=self.model_name,
                                      version=-1)
        except WeightSyncError as e:
            self._session = False
            return _error(400, e.reason)
        return web.json_response({"message": "Weights updated"})

    async def finish_update(self, request: web.Request) -> web.Response:
        body = await _json(request)
        version = body.get("weight_version")
        staged, self._staged, active, self._session = self._staged, None, self._session, False
        if not active or staged is None:
            return _error(400, "No checkpoint was loaded during the shared-disk update "
                          "session")
        number = self.policy.version if version is None else _int(version)
        if number is None:
            return _error(400, f"weight_version must be an integer here, not {version!r}")
        await asyncio.to_thread(self.policy.update_weights, staged, number)
        self._version_set = True
        log.info("hf-server %s: weights version %d loaded", self.model_name, number)
        return web.json_response({"message": "Weight update finished"})

    async def set_version(self, request: web.Request) -> web.Response:
        body = await _json(request)
        number = _int(body.get("new_version"))
        if number is None:
            return _error(400, "new_version must be an integer")
        self.policy.version = number
        self._version_set = True
        return web.json_response({"success": True, "new_version": body["new_version"]})

    async def weight_info(self, request: web.Request) -> web.Response:
        version = str(self.policy.version) if self._version_set else "default"
        return web.json_response({"weight_version": version})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        body = await _json(request)
        if body.get("method") != "reload_weights":
            return _error(400, f"hf-server runs only the reload_weights RPC, not "
                          f"{body.get('method')!r}")
        kwargs = body.get("kwargs") or {}
        try:
            state = await asyncio.to_thread(_read_checkpoint, kwargs.get("weights_path"),
                                            self.model_name)
            full = full_state(self.policy.model, state, engine=self.model_name, version=-1)
        except WeightSyncError as e:
            return _error(400, e.reason)
        await asyncio.to_thread(self.policy.update_weights, full, self.policy.version)
        log.info("hf-server %s: weights reloaded from %s", self.model_name,
                 kwargs.get("weights_path"))
        return web.json_response({"results": [None]})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True})

    async def stats(self, request: web.Request) -> web.Response:
        assert self._resumed is not None
        return web.json_response({
            "batch_sizes": {str(k): v for k, v in sorted(self.policy.batch_sizes.items())},
            "requests": self.requests, "weight_version": str(self.policy.version),
            "is_paused": not self._resumed.is_set()})


def _read_checkpoint(path: Any, engine: str) -> dict[str, Any]:
    """The tensors of a safetensors folder (an absolute path, as vLLM's reload takes)."""
    if not isinstance(path, str) or not Path(path).is_absolute() or not Path(path).is_dir():
        raise WeightSyncError(engine, -1, f"`path` must be an absolute local directory: "
                              f"{path!r}")
    return read_weights(path, engine=engine, require_marker=False)


async def _json(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        data = await request.json()
    except (ValueError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _int(value: Any) -> int | None:
    try:
        return int(str(value))
    except ValueError:
        return None


def run_server(model_dir: str | Path, *, host: str = "127.0.0.1", port: int = 8000,
               max_batch: int = 16, max_tokens: int = 256, temperature: float = 1.0,
               served_model_name: str | None = None, device: str | None = None,
               seed: int | None = None, ready: Any = None) -> None:
    """Load ``model_dir`` and serve it until SIGINT/SIGTERM (``tmax serve``)."""
    import signal

    policy = load_policy(model_dir, device=device, max_batch=max_batch,
                         max_new_tokens=max_tokens, temperature=temperature, seed=seed)
    server = HFServer(policy, model_name=served_model_name or str(model_dir), host=host,
                      port=port)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, server.stop_serving)
        await server.serve(ready)

    asyncio.run(main())
