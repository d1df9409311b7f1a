"""Audit and repair of tasks: deterministic probes in real sandboxes, an optional LLM
auditor, repairs of the fixable labels (``tmax audit``, ``tmax repair``)."""

from tmax.audit.labels import FIXABLE, LABELS, PROBE_LABELS, Label, describe

__all__ = ["FIXABLE", "LABELS", "PROBE_LABELS", "Label", "describe"]
