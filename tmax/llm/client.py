"""``Teacher``: chat completions from any OpenAI-compatible endpoint, for data pipelines.

- Transport: one ``OpenAIPolicy`` per teacher, whose ``call()`` owns the retries (capped
  exponential backoff on 408/429/5xx and transport errors) and the concurrency slots.
- Rate limit: request starts are spaced ``60 / requests_per_minute`` seconds apart.
- Cache: each response is stored under ``sha256(model, messages, sampling params)`` in
  ``cache_dir`` (written to a temporary file and renamed), so a rerun of an interrupted run
  gets every reply it already paid for from disk, in the same order.
- Accounting: ``Usage`` counts requests, cache hits, prompt and completion tokens of paid
  requests, parse failures and dropped conversations; cost from per-1M-token prices.
- Structured output: ``structured(messages, Model)`` parses the reply as one JSON object
  matching the pydantic ``Model``; a reply that does not parse is answered with the parse
  error and asked again (``parse_retries`` times), then ``StructuredOutputError``.

The API key comes from the environment variable the config names (``api_key_env``), never
from the config file.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import json
import logging
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tmax.agent.policies.openai import OpenAIPolicy
from tmax.agent.policy import PolicyError, PolicyUnavailable

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
CACHE_FORMAT = "tmax-llm-cache-v1"


class TeacherConfig(BaseModel):
    """The teacher endpoint and how to use it (``teacher:`` in configs/gen.yaml)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_url: str = "http://127.0.0.1:8000/v1"
    """An OpenAI-compatible base URL ending in /v1 (a hosted API, vLLM, ``tmax serve``)."""
    model: str = "teacher"
    """The model name sent with each request."""
    api_key_env: str | None = "OPENAI_API_KEY"
    """Environment variable holding the API key (None or unset: no key sent)."""
    concurrency: int = Field(default=8, ge=1)
    """Most requests in flight at once."""
    requests_per_minute: float = Field(default=0.0, ge=0)
    """Most request starts per minute (0: no limit)."""
    temperature: float = Field(default=0.7, ge=0)
    max_tokens: int | None = Field(default=None, ge=1)
    extra_body: dict[str, Any] = Field(default_factory=dict)
    """Extra request fields (e.g. ``response_format: {type: json_object}``); part of the
    cache key."""
    timeout_s: float = Field(default=600.0, gt=0)
    """Per request."""
    max_retries: int = Field(default=5, ge=0)
    """Retries of one request on 408/429/5xx and transport errors."""
    backoff_s: float = Field(default=1.0, ge=0)
    """First retry delay (doubles each retry, capped at 60 s)."""
    parse_retries: int = Field(default=2, ge=0)
    """Times a reply that does not parse is sent back with its error before it is dropped."""
    cache_dir: str | None = None
    """Response cache folder (None: ``<out>/teacher-cache`` for ``tmax gen``)."""
    price_prompt_per_m: float = Field(default=0.0, ge=0)
    """Price of 1M prompt tokens (any currency; 0: not costed)."""
    price_completion_per_m: float = Field(default=0.0, ge=0)
    """Price of 1M completion tokens."""


class TeacherUnavailable(Exception):
    """The endpoint could not be used (after retries, or misconfigured): an infrastructure
    failure, not the teacher's answer."""


class StructuredOutputError(Exception):
    """No reply parsed within the allowed attempts; ``errors`` holds each parse error and
    ``messages`` the whole conversation."""

    def __init__(self, errors: list[str], messages: list[dict[str, Any]]):
        self.errors, self.messages = errors, messages
        super().__init__(f"no parsable reply after {len(errors)} attempts; last: "
                         f"{errors[-1][:500] if errors else '-'}")


@dataclass
class Usage:
    """What a teacher has spent; ``cost`` from the config's prices."""

    requests: int = 0
    """Paid requests (answered by the endpoint)."""
    cache_hits: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    parse_failures: int = 0
    """Replies that did not parse (each retried or dropped)."""
    dropped: int = 0
    """Conversations given up after ``parse_retries``."""
    seconds: float = 0.0
    """Wall time spent in paid requests (summed over concurrent ones)."""
    cost: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def add(self, **counts: float) -> None:
        for name, value in counts.items():
            setattr(self, name, getattr(self, name) + value)


_tracked: contextvars.ContextVar[Usage | None] = contextvars.ContextVar("tmax_llm_usage",
                                                                      default=None)


@contextlib.contextmanager
def track_usage():
    """``with track_usage() as usage:`` counts, in ``usage``, what the teacher calls made in
    this context (an asyncio task: one generated item) spend, besides the teacher's total."""
    usage = Usage()
    token = _tracked.set(usage)
    try:
        yield usage
    finally:
        _tracked.reset(token)


@dataclass(frozen=True)
class Reply:
    content: str
    prompt_tokens: int
    completion_tokens: int
    cached: bool


@dataclass
class _RateLimit:
    per_minute: float
    _next: float = 0.0
    _lock: asyncio.Lock | None = field(default=None, repr=False)

    async def wait(self) -> None:
        if self.per_minute <= 0:
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            now = time.monotonic()
            if self._next > now:
                await asyncio.sleep(self._next - now)
            self._next = max(now, self._next) + 60.0 / self.per_minute


class ResponseCache:
    """Responses on disk, one JSON file per key (``<dir>/<key[:2]>/<key>.json``)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    @staticmethod
    def key(body: dict[str, Any]) -> str:
        raw = json.dumps([CACHE_FORMAT, body], sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(raw.encode()).hexdigest()

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def get(self, key: str) -> dict[str, Any] | None:
        try:
            data = json.loads(self.path(key).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def put(self, key: str, data: dict[str, Any]) -> None:
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{key[:12]}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


_FENCE = re.compile(r"```(?:json)?\s*\n(.*?)\n```", re.DOTALL)


def parse_json_reply(content: str, model: type[M]) -> M:
    """``content`` as ``model``: the whole reply, else its one fenced block, else the text
    from its first ``{`` to its last ``}``. ``ValueError`` with a readable reason."""
    text = content.strip()
    candidates = [text] if text[:1] in ("{", "[") else []
    candidates += _FENCE.findall(text)
    if "{" in text:
        candidates.append(text[text.index("{"):text.rindex("}") + 1] if "}" in text
                          else text[text.index("{"):])
    error = "the reply holds no JSON object"
    for candidate in candidates:
        try:
            data = json.loads(candidate)
        except ValueError as e:
            error = f"not valid JSON: {e}"
            continue
        if not isinstance(data, dict):
            error = f"expected one JSON object, got {type(data).__name__}"
            continue
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise ValueError(_validation_text(e)) from None
    raise ValueError(error)


def _validation_text(e: ValidationError) -> str:
    lines = [f"the JSON does not match the schema ({e.error_count()} errors):"]
    for err in e.errors()[:12]:
        where = ".".join(str(x) for x in err["loc"]) or "(top level)"
        lines.append(f"- {where}: {err['msg']}")
    return "\n".join(lines)


class Teacher:
    """One endpoint, used from one event loop at a time (``async with`` closes it)."""

    def __init__(self, config: TeacherConfig, *, cache_dir: str | Path | None = None):
        self.config = config
        key = os.environ.get(config.api_key_env) if config.api_key_env else None
        self.policy = OpenAIPolicy(
            config.base_url, config.model, api_key=key or "", concurrency=config.concurrency,
            timeout_s=config.timeout_s, max_retries=config.max_retries,
            backoff_s=config.backoff_s, temperature=config.temperature,
            max_tokens=config.max_tokens, supports_tools=False, extra_body=config.extra_body,
            name=f"teacher:{config.model}")
        where = cache_dir or config.cache_dir
        self.cache = ResponseCache(where) if where else None
        self.usage = Usage()
        self._rate = _RateLimit(config.requests_per_minute)

    async def __aenter__(self) -> Teacher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.policy.aclose()

    async def chat(self, messages: list[dict[str, Any]]) -> Reply:
        """One completion (from the cache when this exact request was answered before)."""
        body = self.policy.request_body(messages, None)
        key = ResponseCache.key(body)
        data = self.cache.get(key) if self.cache else None
        if data is not None:
            self._count(cache_hits=1)
            completion = self.policy.parse(data)
            return Reply(completion.content, completion.prompt_tokens,
                         completion.completion_tokens, True)
        await self._rate.wait()
        start = time.monotonic()
        try:
            data = await self.policy.call(self.policy.url, body)
            completion = self.policy.parse(data)
        except (PolicyUnavailable, PolicyError) as e:
            raise TeacherUnavailable(str(e)) from None
        finally:
            self._count(seconds=time.monotonic() - start)
        p, c = completion.prompt_tokens, completion.completion_tokens
        self._count(requests=1, prompt_tokens=p, completion_tokens=c,
                    cost=(p * self.config.price_prompt_per_m
                          + c * self.config.price_completion_per_m) / 1e6)
        if self.cache:
            self.cache.put(key, data)
        return Reply(completion.content, p, c, False)

    def _count(self, **counts: float) -> None:
        self.usage.add(**counts)
        if (tracked := _tracked.get()) is not None:
            tracked.add(**counts)

    async def structured(self, messages: list[dict[str, Any]], model: type[M]
                         ) -> tuple[M, list[dict[str, Any]]]:
        """A reply parsed as ``model``, and the conversation ending with that reply.

        A reply that does not parse goes back with its error (bounded by ``parse_retries``);
        then ``StructuredOutputError``. ``TeacherUnavailable`` when the endpoint fails.
        """
        conversation = list(messages)
        errors: list[str] = []
        for _ in range(self.config.parse_retries + 1):
            reply = await self.chat(conversation)
            conversation.append({"role": "assistant", "content": reply.content})
            try:
                return parse_json_reply(reply.content, model), conversation
            except ValueError as e:
                errors.append(str(e))
                self._count(parse_failures=1)
                log.info("teacher reply did not parse: %s", str(e)[:200])
                conversation.append({"role": "user", "content": (
                    f"Your reply could not be used: {e}\nReply again with only one JSON "
                    "object that matches the schema, no other text.")})
        self._count(dropped=1)
        raise StructuredOutputError(errors, conversation)
