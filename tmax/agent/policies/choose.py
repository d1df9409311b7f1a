"""Policies by name: ``make_policy("oracle")``, ``"nop"``, ``"scripted:FILE"``,
``"openai:MODEL@URL"``, ``"hf:PATH"`` (a local transformers model), ``"vllm:PATH"`` (a
local model folder behind a vLLM server TMax starts: ``tmax.inference.served``; call its
``start()`` before and ``aclose()`` after the episodes). Imports lazily."""

from __future__ import annotations

from typing import Any


class PolicySpecError(ValueError):
    pass


NAMES = ("oracle", "nop", "scripted:FILE", "openai:MODEL@URL", "hf:PATH", "vllm:PATH")


def make_policy(spec: str, **options: Any):
    """Build a policy from its spec string (see ``NAMES``); ``options`` go to its class."""
    kind, _, arg = spec.partition(":")
    if kind == "oracle":
        from tmax.agent.policies.simple import OraclePolicy
        return OraclePolicy(**options)
    if kind == "nop":
        from tmax.agent.policies.simple import NopPolicy
        return NopPolicy(**options)
    if kind == "scripted" and arg:
        from tmax.agent.policies.simple import ScriptedPolicy
        return ScriptedPolicy.from_file(arg)
    if kind == "openai" and arg:
        from tmax.agent.policies.openai import OpenAIPolicy
        model, _, url = arg.rpartition("@")
        if not model:
            raise PolicySpecError(f"policy {spec!r}: write openai:MODEL@BASE_URL, e.g. "
                                  "openai:qwen3@http://127.0.0.1:8000/v1")
        return OpenAIPolicy(url, model, **options)
    if kind == "hf" and arg:
        from tmax.agent.policies.hf import HFPolicy
        return HFPolicy.from_pretrained(arg, **options)
    if kind == "vllm" and arg:
        from tmax.inference.served import VLLMPolicy
        return VLLMPolicy(arg, **options)
    raise PolicySpecError(f"unknown policy {spec!r}; choose one of: {', '.join(NAMES)}")
