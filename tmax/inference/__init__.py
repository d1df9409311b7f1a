"""Inference engines behind one seam (``InferenceEngine`` in ``base``).

Backends, chosen by name with ``make_engine`` (imported lazily):

- ``http``: ``HttpEngine``, a client of ``vllm serve`` or ``tmax serve`` (same requests);
- ``inprocess``: ``InProcessEngine``, HFPolicy in this process;
- ``vllm``: ``tmax.inference.vllm`` builds the ``vllm serve`` command and owns the process
  (``VLLMServer``), then drives it with ``HttpEngine``;
- ``hf-server``: ``tmax.inference.hf_server``, the server behind ``tmax serve MODEL_DIR``.

See docs/inference.md.
"""

from __future__ import annotations

from typing import Any

from tmax.inference.base import (
    EngineError,
    EngineStartError,
    EngineUnavailable,
    InferenceEngine,
    WeightSyncError,
    read_weights,
    weights_dir,
    write_weights,
)

__all__ = ["ENGINES", "EngineError", "EngineStartError", "EngineUnavailable",
           "InferenceEngine", "WeightSyncError", "make_engine", "read_weights", "weights_dir",
           "write_weights"]

ENGINES = ("http", "inprocess")


def make_engine(kind: str, **options: Any) -> InferenceEngine:
    """``make_engine("http", base_url=URL, model=NAME, ...)`` or
    ``make_engine("inprocess", path=MODEL_DIR, ...)``; ValueError naming the choices."""
    if kind == "http":
        from tmax.inference.http import HttpEngine
        return HttpEngine(**options)
    if kind == "inprocess":
        from tmax.inference.inprocess import InProcessEngine
        return InProcessEngine.from_pretrained(**options)
    raise ValueError(f"unknown inference engine {kind!r}; choose one of: {', '.join(ENGINES)}")
