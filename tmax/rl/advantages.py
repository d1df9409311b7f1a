"""Group advantages over valid rollouts (GRPO-style, centered by default).

For one prompt's group of rollouts with rewards r_i in [0,1], over the set V of valid
(not infra-failed) rollouts only:

    A_i = r_i - mean_{j in V} r_j                      (TMax default: centered)
    A_i = (r_i - mean_V r) / (std_V r + eps)           (normalize_std=True; population std)

Infra-failed rollouts get no advantage (None) and are left out of the mean and std: an
infrastructure failure is not a reward of 0. A group is dropped (all None) when it has fewer
than ``min_valid`` valid rollouts, or when its valid rewards all match (zero std: no
learning signal); active sampling refills the batch elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

ZERO_STD_TOL = 1e-12
"""A group whose valid rewards have population std at or below this is "zero_std"."""


@dataclass(frozen=True)
class GroupAdvantages:
    """Advantages of one group, aligned with its rollouts."""

    advantages: tuple[float | None, ...]
    """One per rollout; None for rollouts that carry no loss (invalid, or group dropped)."""
    kept: bool
    """False when the whole group is dropped from the update."""
    reason: Literal["ok", "too_few_valid", "zero_std"]
    """Why the group was dropped ("ok" when kept)."""
    n_valid: int
    """Number of valid (not infra-failed) rollouts in the group."""


def group_advantages(
    rewards: Sequence[float | None],
    valid: Sequence[bool],
    *,
    normalize_std: bool = False,
    eps: float = 1e-6,
    min_valid: int = 2,
) -> GroupAdvantages:
    """Advantages of one group: A_i = r_i - mean_V(r), or / (std_V(r) + eps) if normalize_std.

    V is the set of valid rollouts; std is the population std sqrt(mean_V((r - mean_V r)^2)).
    Invalid rollouts get None. Fewer than ``min_valid`` valid rollouts -> dropped with reason
    "too_few_valid"; std_V(r) <= 1e-12 -> dropped with reason "zero_std".

    Raises ValueError when the lengths differ, a valid rollout has no reward, or a reward
    is outside [0,1].
    """
    if len(rewards) != len(valid):
        raise ValueError(f"rewards ({len(rewards)}) and valid ({len(valid)}) differ in length")
    if min_valid < 1:
        raise ValueError(f"min_valid must be >= 1, got {min_valid}")
    for i, (r, v) in enumerate(zip(rewards, valid)):
        if r is None:
            if v:
                raise ValueError(f"rollout {i} is valid but has no reward")
        elif not 0.0 <= r <= 1.0:  # also rejects NaN
            raise ValueError(f"rollout {i} has reward {r!r} outside [0,1]")

    vals = [float(r) for r, v in zip(rewards, valid) if v]  # type: ignore[arg-type]
    n_valid = len(vals)
    dropped = tuple(None for _ in rewards)
    if n_valid < min_valid:
        return GroupAdvantages(dropped, kept=False, reason="too_few_valid", n_valid=n_valid)

    mean = math.fsum(vals) / n_valid
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in vals) / n_valid)  # population std
    if std <= ZERO_STD_TOL:
        return GroupAdvantages(dropped, kept=False, reason="zero_std", n_valid=n_valid)

    scale = (std + eps) if normalize_std else 1.0
    advs = tuple(
        (float(r) - mean) / scale if v else None  # type: ignore[arg-type]
        for r, v in zip(rewards, valid)
    )
    return GroupAdvantages(advs, kept=True, reason="ok", n_valid=n_valid)


def infra_mask(trajectories: Sequence[Any]) -> list[bool]:
    """Valid flags: True where ``t.infra_failure is None`` (duck-typed, e.g. Trajectory)."""
    return [t.infra_failure is None for t in trajectories]


def filter_groups(groups: Sequence[GroupAdvantages]) -> list[int]:
    """Indices of the groups that are kept."""
    return [i for i, g in enumerate(groups) if g.kept]
