"""Verifier isolation as one component: ``plan`` decides the verifier's view of a sandbox
purely (``plan_view``); each runtime applies the ``VerifierPlan`` it returns."""

from sandfleet.verifier.plan import (
    INSTALLER_FILES,
    PRISTINE,
    PYTHON_DIR,
    TOP_LEVEL_MAX,
    VERIFIER_ENV,
    VERIFIER_TOOLS,
    Fix,
    Mount,
    VerifierPlan,
    path_roots,
    plan_view,
    trusted_first,
)
from sandfleet.verifier.tree import DirTree, MemoryTree, Tree

__all__ = ["INSTALLER_FILES", "PRISTINE", "PYTHON_DIR", "TOP_LEVEL_MAX", "VERIFIER_ENV",
           "VERIFIER_TOOLS", "DirTree", "Fix", "MemoryTree", "Mount", "Tree", "VerifierPlan",
           "path_roots", "plan_view", "trusted_first"]
