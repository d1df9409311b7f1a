"""Sandbox runtimes, chosen by short name: ``get_runtime("local", state_dir=..., ...)``.

Backends import lazily, so picking one never loads the others.
"""

from __future__ import annotations

import importlib
from typing import Any

RUNTIMES = {
    "local": "sandfleet.runtime.local:LocalRuntime",
    "apptainer": "sandfleet.runtime.apptainer:ApptainerRuntime",
}


def get_runtime(name: str, **kwargs: Any):
    """An instance of the runtime called ``name``, built with ``kwargs``."""
    try:
        module, _, cls = RUNTIMES[name].partition(":")
    except KeyError:
        raise ValueError(f"unknown runtime {name!r}; valid: {', '.join(RUNTIMES)}") from None
    return getattr(importlib.import_module(module), cls)(**kwargs)
