"""The eight audit labels, each with its one-line meaning, and which of them a repair fixes.

A task gets at most one label. The deterministic probes assign the labels they can prove
(``PROBE_LABELS``); the LLM auditor, when a teacher is configured, decides the rest, and only
it says ``clean``: with the probes alone a task they cannot fault stays unlabelled.
"""

from __future__ import annotations

from typing import Literal, get_args

Label = Literal["clean", "verifier_too_weak", "answer_leak", "instruction_verifier_mismatch",
                "verifier_too_strict", "underspecified_instruction", "environment_broken",
                "solution_broken"]

LABELS: dict[str, str] = {
    "clean": "the instruction, environment, verifier and solution agree; nothing to fix",
    "verifier_too_weak": "the verifier passes work that does not do what the instruction asks "
                         "(existence only, one fixed value, never runs the program, always "
                         "passes)",
    "answer_leak": "the environment holds the answer (usually what the verifier compares "
                   "against) where the agent can read it",
    "instruction_verifier_mismatch": "the verifier checks something the instruction does not "
                                     "ask for (another path, name or format)",
    "verifier_too_strict": "the verifier fails correct work the instruction allows",
    "underspecified_instruction": "the instruction leaves out what the verifier needs to "
                                  "pass",
    "environment_broken": "the image does not start, or the verifier cannot grade in it",
    "solution_broken": "the reference solution does not get full reward",
}
assert set(LABELS) == set(get_args(Label))

FIXABLE: tuple[Label, ...] = ("answer_leak", "verifier_too_weak",
                              "instruction_verifier_mismatch")
"""The labels a repair is tried for; a task with any other label but clean is dropped."""

PROBE_LABELS: tuple[Label, ...] = ("environment_broken", "solution_broken", "answer_leak",
                                   "verifier_too_weak", "instruction_verifier_mismatch")
"""The labels the deterministic probes can prove, in the order they win when several apply."""


def describe(label: str) -> str:
    """``label: meaning``; ``ValueError`` naming the known labels for an unknown one."""
    if label not in LABELS:
        raise ValueError(f"unknown audit label {label!r}; the labels are: "
                         f"{', '.join(LABELS)}")
    return f"{label}: {LABELS[label]}"


__all__ = ["FIXABLE", "LABELS", "PROBE_LABELS", "Label", "describe"]
