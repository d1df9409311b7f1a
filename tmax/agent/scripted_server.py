"""A scripted OpenAI-compatible server, to test a setup end to end without a model.

``ScriptedServer(responses)`` serves ``GET /v1/models`` and ``POST /v1/chat/completions``
on a loopback port from a background thread; each POST consumes the next scripted item:

- ``"ls -la"``: a command (a ``bash`` tool call when the request offers tools, else a
  fenced ```bash block);
- ``{"content": ..., "reasoning": ..., "tool_calls": [{"name": "bash", "arguments":
  {"command": "ls"}}]}``: an assistant turn (``arguments`` may be a dict or a raw string,
  ``id`` is optional; ``finish_reason`` overrides ``tool_calls``/``stop``);
- ``{"status": 503, "body": {...}}``: an HTTP error (``body`` a dict or a string);
- ``"delay_s": 2.0`` in any item: sleep that long before answering (to test timeouts).

When the script runs out it submits (``echo TMAX_TASK_COMPLETE``). Usage counts are
whitespace-split words. A request with ``return_token_ids``/``logprobs`` (vLLM's extra
fields) gets made-up but consistent ``prompt_token_ids``, ``choices[0].token_ids`` and
per-token logprobs, one per word. ``.requests`` keeps every request body; ``.max_in_flight``
the most chat requests handled at once.

Serve one from the command line with ``tmax serve-scripted SCRIPT`` (``tmax.agent.cli``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self

import yaml

from tmax.agent.config import SUBMIT_MARKER

log = logging.getLogger(__name__)
ItemT = str | dict[str, Any]


class ScriptError(ValueError):
    """A script file that is not a list of responses."""


class ScriptedServer:
    """``with ScriptedServer([...]) as server: OpenAIPolicy(server.url, "scripted")``."""

    def __init__(self, responses: list[ItemT], *, host: str = "127.0.0.1", port: int = 0,
                 model: str = "scripted"):
        self.responses, self.host, self.port, self.model = list(responses), host, port, model
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def from_file(cls, path: str | Path, **kwargs: Any) -> ScriptedServer:
        """A JSON or YAML list of items, or a mapping ``{responses: [...], model: ...}``."""
        data = yaml.safe_load(Path(path).read_text())  # YAML is a superset of JSON
        if isinstance(data, dict):
            kwargs.setdefault("model", data.get("model", "scripted"))
            data = data.get("responses")
        if not isinstance(data, list):
            raise ScriptError(f"{path}: expected a list of responses (or {{responses: [...]}})")
        return cls(data, **kwargs)

    @property
    def url(self) -> str:
        """The base URL, ending in /v1."""
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> Self:
        self._stop.clear()
        self._httpd = ThreadingHTTPServer((self.host, self.port), _handler(self))
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name=f"scripted-server-{self.port}", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()  # wakes handlers sleeping on a delay
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- answers

    def _next(self) -> ItemT | None:
        with self._lock:
            return self.responses.pop(0) if self.responses else None

    def chat(self, body: dict[str, Any]) -> tuple[int, dict[str, Any] | str]:
        """Status and JSON (or text) for one chat request: the next scripted item."""
        with self._lock:
            self.requests.append(body)
        item = self._next()
        if item is None:
            item = f"echo {SUBMIT_MARKER}"
        if isinstance(item, dict) and item.get("delay_s"):
            self._stop.wait(float(item["delay_s"]))
        if isinstance(item, dict) and "status" in item:
            status = int(item["status"])
            default = {"error": {"message": f"scripted HTTP {status}", "type": "scripted",
                                 "code": status}}
            return status, item.get("body", default)
        return 200, self.completion(item, body)

    def completion(self, item: ItemT, request: dict[str, Any]) -> dict[str, Any]:
        """A ``chat.completion`` object for a scripted item."""
        if isinstance(item, str):
            item = ({"tool_calls": [{"name": "bash", "arguments": {"command": item}}]}
                    if request.get("tools") else {"content": f"```bash\n{item}\n```"})
        assert isinstance(item, dict)
        calls: list[dict[str, Any]] = [
            {"id": c.get("id") or f"call_{uuid.uuid4().hex[:12]}", "type": "function",
             "function": {"name": c.get("name", "bash"),
                          "arguments": c["arguments"] if isinstance(c.get("arguments"), str)
                          else json.dumps(c.get("arguments", {}))}}
            for c in item.get("tool_calls", [])]
        message: dict[str, Any] = {"role": "assistant", "content": item.get("content")}
        if item.get("reasoning"):
            message["reasoning_content"] = item["reasoning"]
        if calls:
            message["tool_calls"] = calls
        out_words = _words(item.get("reasoning"), item.get("content"),
                           *(c["function"]["arguments"] for c in calls))
        prompt_words = _words(*(_text(m.get("content")) for m in request.get("messages", [])))
        choice: dict[str, Any] = {
            "index": 0, "message": message,
            "finish_reason": item.get("finish_reason") or ("tool_calls" if calls else "stop")}
        data: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex[:16]}", "object": "chat.completion",
            "created": int(time.time()), "model": request.get("model") or self.model,
            "choices": [choice],
            "usage": {"prompt_tokens": len(prompt_words), "completion_tokens": len(out_words),
                      "total_tokens": len(prompt_words) + len(out_words)}}
        if request.get("logprobs"):
            choice["logprobs"] = {"content": [
                {"token": w, "logprob": -0.5, "top_logprobs": []} for w in out_words]}
        if request.get("return_token_ids"):
            choice["token_ids"] = [_token_id(w) for w in out_words]
            data["prompt_token_ids"] = [_token_id(w) for w in prompt_words]
        return data

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model, "object": "model",
                                            "created": 0, "owned_by": "tmax"}]}

    def _enter(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _leave(self) -> None:
        with self._lock:
            self.in_flight -= 1


def _text(content: Any) -> str:
    if isinstance(content, list):  # content parts
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _words(*texts: Any) -> list[str]:
    return [w for t in texts if t for w in str(t).split()]


def _token_id(word: str) -> int:
    return zlib.crc32(word.encode()) % 50_000


def _handler(server: ScriptedServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("scripted server: %s", format % args)

        def _send(self, status: int, payload: dict[str, Any] | str) -> None:
            raw = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json" if isinstance(
                    payload, dict) else "text/plain")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)
            except (BrokenPipeError, ConnectionResetError):
                log.debug("scripted server: the client left before the answer")

        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/v1/models":
                self._send(200, server.models())
            else:
                self._send(404, {"error": {"message": f"no route {self.path}", "code": 404}})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            if self.path.rstrip("/") != "/v1/chat/completions":
                self._send(404, {"error": {"message": f"no route {self.path}", "code": 404}})
                return
            try:
                body = json.loads(raw)
            except ValueError as e:
                body = f"bad JSON: {e}"
            if not isinstance(body, dict):
                message = body if isinstance(body, str) else "the body must be a JSON object"
                self._send(400, {"error": {"message": message, "code": 400}})
                return
            server._enter()
            try:
                status, payload = server.chat(body)
            finally:
                server._leave()
            self._send(status, payload)

    return Handler
