"""Limits of the deterministic probes (``probes:`` in configs/audit.yaml; strict)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ProbeSettings(BaseModel):
    """How much the probes look at and run per task."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_file_bytes: int = Field(default=1 << 20, ge=1)
    """Files larger than this are neither leak candidates nor replayed outputs."""
    max_scan_bytes: int = Field(default=64 << 20, ge=1)
    """Most bytes of the image's added files read for the leak scan (task folders first,
    then system ones, smallest first); the rest is listed as not scanned."""
    max_candidates: int = Field(default=4, ge=0)
    """Leak candidates taken to the copy probe (most specific first)."""
    max_outputs: int = Field(default=4, ge=1)
    """Output locations each candidate is copied to."""
    min_leak_chars: int = Field(default=4, ge=1)
    """Shorter answers (after stripping whitespace) are not searched for in the image."""
    exploits: bool = True
    """Run the exploit probes (``tmax.audit.exploits``): one sandbox of scripted hacks per
    task, one more where the tests could import the agent's Python modules, and one per
    hack to name it where they pass."""
    exec_timeout_s: float = Field(default=120.0, gt=0)
    """Limit on each probe's own commands (listing and hashing the image, copies)."""


__all__ = ["ProbeSettings"]
