"""Evaluation: run a policy on tasks through the fleet (``runner.run_eval``; tasks that
cannot run are skipped by ``runner.preflight``), summarize the records
(``summary.summarize``, ``pass_at_k``, ``format_tables``) and plot them
(``report.write_plots``). Names import lazily, so ``tmax --help`` stays fast."""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {"EvalError": "runner", "Skipped": "runner", "preflight": "runner",
          "run_eval": "runner", "format_tables": "summary", "pass_at_k": "summary",
          "summarize": "summary", "write_plots": "report"}


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(f"tmax.eval.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'tmax.eval' has no attribute {name!r}")


__all__ = ["EvalError", "Skipped", "format_tables", "pass_at_k", "preflight", "run_eval",
           "summarize", "write_plots"]
