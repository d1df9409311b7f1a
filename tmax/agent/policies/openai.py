"""``openai:MODEL@URL``: a policy served by any OpenAI-compatible ``/v1/chat/completions``
endpoint (a vLLM server, a hosted API).

Failures are sorted by whose they are:

- transport errors (connect, read timeout) and HTTP 408/429/5xx are retried with capped
  exponential backoff and jitter; after ``max_retries`` retries ``PolicyUnavailable`` (an
  infrastructure failure: the rollout records it, evaluation re-runs it);
- HTTP 401/403/404 (wrong key, URL or model name) are ``PolicyUnavailable`` at once: a
  misconfigured endpoint must not be scored as the policy's zero;
- HTTP 400 saying the context is too long is ``ContextLimit``; any other 4xx, and a 200
  without a usable choice, is ``PolicyError`` with the server's message (policy outcomes).

With ``return_tokens`` (vLLM >= 0.10.2) each request also asks for ``logprobs: true`` and
``return_token_ids: true``; vLLM then answers with ``prompt_token_ids`` (top level),
``choices[0].token_ids`` and ``choices[0].logprobs.content[i].logprob``, which fill the
completion's ``prompt_ids``, ``completion_ids`` and ``logprobs`` for training.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
import uuid
from typing import Any

import httpx

from tmax.agent.policy import Completion, ContextLimit, PolicyError, PolicyUnavailable, ToolCall

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 429})
CONFIG_STATUS = frozenset({401, 403, 404})
CONTEXT_RE = re.compile(r"context length|context_length|context window|prompt is too long",
                        re.IGNORECASE)


class _Retry(Exception):
    """One failed attempt that may succeed later; ``wait_s`` is the server's Retry-After."""

    def __init__(self, reason: str, wait_s: float = 0.0):
        self.reason, self.wait_s = reason, wait_s
        super().__init__(reason)


class OpenAIPolicy:
    """A chat-completions endpoint as a policy; one instance serves concurrent episodes
    (at most ``concurrency`` requests in flight per event loop)."""

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None,
                 concurrency: int = 16, timeout_s: float = 600.0, max_retries: int = 5,
                 backoff_s: float = 1.0, max_backoff_s: float = 60.0,
                 temperature: float = 1.0, max_tokens: int | None = None,
                 supports_tools: bool = True, return_tokens: bool = False,
                 extra_body: dict[str, Any] | None = None, name: str | None = None):
        if concurrency < 1 or max_retries < 0 or timeout_s <= 0:
            raise ValueError("need concurrency >= 1, max_retries >= 0 and timeout_s > 0")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.concurrency, self.timeout_s, self.max_retries = concurrency, timeout_s, max_retries
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.temperature, self.max_tokens = temperature, max_tokens
        self.supports_tools, self.return_tokens = supports_tools, return_tokens
        self.extra_body = dict(extra_body or {})
        self.name = name or f"openai:{model}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: httpx.AsyncClient | None = None
        self._slots: asyncio.Semaphore | None = None

    def _session(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        """The client and the concurrency slots of the running loop (made on first use)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            limits = httpx.Limits(max_connections=self.concurrency,
                                  max_keepalive_connections=self.concurrency)
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s),
                                             headers=headers, limits=limits)
            self._slots = asyncio.Semaphore(self.concurrency)
            self._loop = loop
        assert self._slots is not None
        return self._client, self._slots

    async def aclose(self) -> None:
        """Close the HTTP client (call it on the loop that used the policy)."""
        client, self._client, self._loop = self._client, None, None
        if client is not None:
            await client.aclose()

    def request_body(self, messages: list[dict[str, Any]],
                     tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": messages,
                                "temperature": self.temperature}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if tools:
            body["tools"] = tools
        if self.return_tokens:
            body["logprobs"] = True
            body["return_token_ids"] = True
        body.update(self.extra_body)
        return body

    async def complete(self, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None = None) -> Completion:
        return self.parse(await self.call(self.url, self.request_body(messages, tools)))

    async def call(self, url: str, body: dict[str, Any] | None = None, *,
                   method: str = "POST", params: dict[str, str] | None = None
                   ) -> dict[str, Any]:
        """``method`` (POST) ``body`` to ``url`` with this policy's retries and error sorting; the
        response JSON object (an empty body reads as ``{}``). Inference clients
        (``tmax.inference.http``) send their control requests through it too."""
        for attempt in range(self.max_retries + 1):
            try:
                return await self._post(body, url, params, method)
            except _Retry as e:
                if attempt == self.max_retries:
                    raise PolicyUnavailable(
                        self.name, f"{e.reason} (after {attempt + 1} attempts)") from None
                delay = self._backoff(attempt, e.wait_s)
                log.warning("policy %s: %s; retry %d/%d in %.2f s", self.name, e.reason,
                            attempt + 1, self.max_retries, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    def _backoff(self, attempt: int, retry_after: float) -> float:
        base = min(self.max_backoff_s, self.backoff_s * 2 ** attempt)
        return min(self.max_backoff_s, max(retry_after, base * random.uniform(0.5, 1.0)))

    async def _post(self, body: dict[str, Any] | None, url: str | None = None,
                    params: dict[str, str] | None = None, method: str = "POST"
                    ) -> dict[str, Any]:
        """One attempt: the response JSON, or _Retry / PolicyError / PolicyUnavailable."""
        client, slots = self._session()
        url = url or self.url
        async with slots:
            try:
                response = await client.request(method, url, json=body, params=params)
            except httpx.TransportError as e:
                raise _Retry(f"{type(e).__name__}: {e or 'no detail'}") from None
        status = response.status_code
        if status in RETRY_STATUS or status >= 500:
            raise _Retry(f"HTTP {status}: {_message(response)}", _retry_after(response))
        if status in CONFIG_STATUS:
            raise PolicyUnavailable(self.name, f"HTTP {status} from {url}: "
                                               f"{_message(response)}")
        if status >= 400:
            message = _message(response)
            if CONTEXT_RE.search(message) or CONTEXT_RE.search(response.text[:4000]):
                raise ContextLimit(self.name, message)
            raise PolicyError(self.name, f"HTTP {status}: {message}")
        if not response.content and url != self.url:
            return {}  # a control route that answers 200 with no body (vLLM's /health)
        try:
            data = response.json()
        except ValueError:
            raise PolicyError(self.name, f"response is not JSON: {response.text[:200]!r}") \
                from None
        if not isinstance(data, dict):
            raise PolicyError(self.name, "response is not a JSON object")
        return data

    def parse(self, data: dict[str, Any]) -> Completion:
        """A chat.completion response as a Completion; PolicyError when malformed."""
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise PolicyError(self.name, f"response has no choices: {str(data)[:200]}")
        choice = choices[0]
        msg = choice.get("message")
        if not isinstance(msg, dict):
            raise PolicyError(self.name, "choices[0] has no message")
        try:
            calls = [_tool_call(c) for c in msg.get("tool_calls") or []]
        except (TypeError, KeyError, AttributeError) as e:
            raise PolicyError(self.name, f"malformed tool_calls: {e}") from None
        usage: dict[str, Any] = data["usage"] if isinstance(data.get("usage"), dict) else {}
        completion = Completion(
            content=msg.get("content") or "",
            reasoning=msg.get("reasoning_content") or msg.get("reasoning") or "",
            tool_calls=calls, finish_reason=choice.get("finish_reason") or "stop",
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0))
        if self.return_tokens:
            self._fill_tokens(completion, data, choice)
        return completion

    def _fill_tokens(self, completion: Completion, data: dict[str, Any],
                     choice: dict[str, Any]) -> None:
        prompt_ids = data.get("prompt_token_ids") or choice.get("prompt_token_ids")
        completion_ids = choice.get("token_ids")
        try:
            content = (choice.get("logprobs") or {}).get("content") or []
            logprobs = [float(e["logprob"]) for e in content]
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            log.warning("policy %s: malformed logprobs (%s); tokens dropped", self.name, e)
            return
        if prompt_ids is None or completion_ids is None:
            log.warning("policy %s: no token ids in the response (return_token_ids needs "
                        "vLLM >= 0.10.2)", self.name)
            return
        if len(logprobs) != len(completion_ids):
            log.warning("policy %s: %d logprobs for %d completion tokens; tokens dropped",
                        self.name, len(logprobs), len(completion_ids))
            return
        completion.prompt_ids = [int(t) for t in prompt_ids]
        completion.completion_ids = [int(t) for t in completion_ids]
        completion.logprobs = logprobs


def _tool_call(call: dict[str, Any]) -> ToolCall:
    fn = call["function"]
    arguments = fn.get("arguments")
    if arguments is None:
        arguments = "{}"
    elif not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return ToolCall(call.get("id") or f"call_{uuid.uuid4().hex[:12]}", str(fn["name"]), arguments)


def _message(response: httpx.Response) -> str:
    """The server's error message (OpenAI ``{"error": {"message"}}``, vLLM, or text)."""
    try:
        data = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:2000]
        if isinstance(err, str):
            return err[:2000]
        if data.get("message"):
            return str(data["message"])[:2000]
    return response.text[:500]


def _retry_after(response: httpx.Response) -> float:
    try:
        return max(0.0, float(response.headers.get("retry-after", 0)))
    except ValueError:
        return 0.0
