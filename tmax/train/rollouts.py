"""Rollouts for the trainer: groups of episodes per task, async, with active sampling.

``GroupSampler`` launches groups (``group_size`` rollouts of one task) in the background
while the trainer steps; each rollout is stamped with the policy version that sampled it.
``next_batch(n, version)`` returns ``n`` usable groups:

- advantages are computed over a group's scored rollouts only (``Trajectory.scored``):
  infra failures and verifier errors (a verifier that could not grade, e.g. one that needed
  the network) get no advantage and stay out of the loss, the same mask; a group with
  fewer than two scored rollouts (reason ``too_few_valid``), or whose scored rewards are all
  equal, carries no gradient and is filtered; sampling goes on until ``n`` usable groups
  are ready (active sampling);
- groups sampled by a policy older than ``version - async_steps`` are dropped as stale;
- ``async_steps == 0`` is synchronous: nothing is sampled while the trainer steps.

If ``abort_after_infra`` rollouts in a row fail on infrastructure, ``next_batch`` raises
``RolloutsFailing`` with the causes instead of letting the run train on nothing. A verifier
error is not an infrastructure failure (the fleet worked); it is logged once per task and
cause. A rollout that ended in TMax's own error (``internal_error``) is neither: it is
masked like a verifier error, and once ``max_internal_errors`` of them have happened
``next_batch`` raises ``InternalErrors`` naming the first (its traceback is in its record,
in the run folder's rollouts file).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tmax.agent.config import AgentConfig
from tmax.rl import GroupAdvantages, group_advantages
from tmax.rollout.run import rollout
from tmax.rollout.trajectory import Trajectory, verifier_error_cause

log = logging.getLogger(__name__)


class RolloutsFailing(Exception):
    """The fleet (or policy endpoint) keeps failing; the run stops rather than train on
    nothing. Carries the failure causes seen."""

    def __init__(self, count: int, causes: Counter):
        self.count, self.causes = count, causes
        what = ", ".join(f"{c} x{n}" for c, n in causes.most_common())
        super().__init__(f"{count} rollouts in a row failed on infrastructure ({what}); "
                         "check the fleet (`sandfleet status`, its logs) and the images "
                         "(`tmax images ls`)")


class InternalErrors(Exception):
    """``count`` rollouts ended in TMax's own error; ``first`` is the first of them."""

    def __init__(self, count: int, first: Trajectory):
        self.count, self.first = count, first
        err = first.internal_error or {}
        tail = "\n".join(str(err.get("traceback", "")).rstrip().splitlines()[-6:])
        super().__init__(f"{count} rollouts ended in an internal error (TMax's own, not the "
                         f"policy's or the fleet's; max_internal_errors); the first, "
                         f"{first.task}: {err.get('message', '?')}\n{tail}\n(every traceback "
                         "is in the run folder's rollout records, field internal_error; please "
                         "report it)")


class NoUsableGroups(Exception):
    """Every recent group was filtered (all rollouts scored alike, or too few were valid):
    the tasks give this policy no learning signal."""

    def __init__(self, count: int, reasons: Counter):
        self.count, self.reasons = count, reasons
        what = ", ".join(f"{r} x{n}" for r, n in reasons.most_common())
        super().__init__(f"{count} groups in a row carried no gradient ({what}): the tasks "
                         "are all solved or all failed by this policy; choose other tasks "
                         "(tasks.include / tasks.difficulty) or a larger group_size")


@dataclass
class Group:
    task: str
    trajectories: list[Trajectory]
    advantages: GroupAdvantages
    launched_version: int
    seconds: float

    @property
    def version(self) -> int:
        """Oldest policy version among the group's sampled turns."""
        versions = [t.policy_version for t in self.trajectories if t.policy_version is not None]
        return min(versions, default=self.launched_version)


@dataclass
class SamplerStats:
    groups_done: int = 0
    groups_filtered: Counter = field(default_factory=Counter)
    groups_stale: int = 0
    rollouts: list[Trajectory] = field(default_factory=list)
    """Rollouts finished since the last ``take_stats``."""


class GroupSampler:
    def __init__(self, tasks: list[Any], policy: Any, fleet: Any, images: Any,
                 agent_config: AgentConfig, *, group_size: int, groups_per_step: int,
                 concurrency: int, async_steps: int, abort_after_infra: int,
                 normalize_std: bool = False, seed: int = 0, on_rollout=None,
                 give_up_after_groups: int = 200, max_internal_errors: int = 3):
        self.tasks, self.policy, self.fleet, self.images = tasks, policy, fleet, images
        self.agent_config = agent_config
        self.group_size, self.groups_per_step = group_size, groups_per_step
        self.async_steps, self.abort_after_infra = async_steps, abort_after_infra
        self.normalize_std = normalize_std
        self.on_rollout = on_rollout
        self.slots = asyncio.Semaphore(concurrency)
        self.rng = random.Random(seed)
        self.order: list[Any] = []
        self.ready: list[Group] = []
        self.inflight = 0
        self.wanted = 0
        self.changed = asyncio.Event()
        self.infra_streak, self.infra_causes = 0, Counter[str]()
        self.give_up_after_groups = give_up_after_groups
        self.filtered_streak, self.filtered_reasons = 0, Counter[str]()
        self.stats = SamplerStats()
        self._verifier_errors_seen: set[tuple[str, str]] = set()
        self.max_internal_errors = max_internal_errors
        self.internal_errors: list[Trajectory] = []
        self.error: BaseException | None = None
        self._producer: asyncio.Task | None = None
        self._groups: set[asyncio.Task] = set()

    @classmethod
    def from_config(cls, config: Any, tasks: list[Any], policy: Any, fleet: Any, images: Any,
                    agent_config: AgentConfig, *, seed: int, on_rollout=None) -> GroupSampler:
        """The sampler of a training run (``TrainConfig``: rollout, fleet, algo sections)."""
        return cls(tasks, policy, fleet, images, agent_config,
                   group_size=config.rollout.group_size,
                   groups_per_step=config.rollout.groups_per_step,
                   concurrency=config.fleet.concurrency,
                   async_steps=config.rollout.async_steps,
                   abort_after_infra=config.fleet.abort_after_infra,
                   normalize_std=config.algo.normalize_std, seed=seed, on_rollout=on_rollout,
                   max_internal_errors=config.fleet.max_internal_errors)

    # ---- lifecycle

    def start(self) -> None:
        self._producer = asyncio.create_task(self._produce())

    async def stop(self) -> None:
        for task in [self._producer, *self._groups]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*[t for t in [self._producer, *self._groups] if t],
                             return_exceptions=True)

    # ---- producing

    def _next_task(self) -> Any:
        if not self.order:
            self.order = list(self.tasks)
            self.rng.shuffle(self.order)
        return self.order.pop()

    def _may_launch(self) -> bool:
        usable = sum(1 for g in self.ready if g.advantages.kept)
        if self.async_steps == 0:  # synchronous: only what the waiting step still needs
            return self.wanted > 0 and usable + self.inflight < self.wanted
        return self.inflight < self.groups_per_step and usable < 2 * self.groups_per_step

    async def _produce(self) -> None:
        while True:
            while not self._may_launch():
                self.changed.clear()
                await self.changed.wait()
            self.inflight += 1
            task = asyncio.create_task(self._group(self._next_task(), self.policy.version))
            self._groups.add(task)
            task.add_done_callback(self._groups.discard)

    async def _one(self, task: Any, trial: int) -> Trajectory:
        async with self.slots:
            traj = await rollout(task, self.policy, self.fleet, self.images,
                                 self.agent_config, trial=trial)
        if self.on_rollout is not None:
            self.on_rollout(traj)
        return traj

    async def _group(self, task: Any, version: int) -> None:
        t0 = time.monotonic()
        try:
            trajs = await asyncio.gather(*[self._one(task, i) for i in range(self.group_size)])
            scored = [t.scored for t in trajs]  # the loss mask: infra and verifier errors out
            adv = group_advantages([t.score if ok else None for t, ok in zip(trajs, scored)],
                                   scored, normalize_std=self.normalize_std)
            self.stats.rollouts.extend(trajs)
            for t in trajs:
                if t.valid:
                    self.infra_streak = 0
                else:
                    self.infra_streak += 1
                    self.infra_causes[(t.infra_failure or {}).get("cause", "infra")] += 1
                if t.valid and t.verifier_error is not None:
                    self._note_verifier_error(t)
                if t.internal_error is not None:
                    self.internal_errors.append(t)
            group = Group(task.task_id, trajs, adv, version, time.monotonic() - t0)
            self.stats.groups_done += 1
            if adv.kept:
                self.ready.append(group)
                self.filtered_streak = 0
            else:
                self.stats.groups_filtered[adv.reason] += 1
                self.filtered_streak += 1
                self.filtered_reasons[adv.reason] += 1
        except Exception as e:  # noqa: BLE001 - surfaced to the trainer by next_batch
            self.error = e
        finally:
            self.inflight -= 1
            self.changed.set()

    def _note_verifier_error(self, t: Trajectory) -> None:
        key = (t.task, verifier_error_cause(t.verifier_error or ""))
        if key not in self._verifier_errors_seen:
            self._verifier_errors_seen.add(key)
            log.warning("%s: verifier error (%s); such rollouts are left out of the loss",
                        t.task, t.verifier_error)

    # ---- consuming

    async def next_batch(self, n: int, version: int) -> list[Group]:
        """``n`` usable groups no older than ``version - async_steps`` (waits for them)."""
        self.wanted = n
        self.changed.set()
        try:
            while True:
                if self.error is not None:
                    raise self.error
                if len(self.internal_errors) >= self.max_internal_errors:
                    raise InternalErrors(len(self.internal_errors), self.internal_errors[0])
                if self.infra_streak >= self.abort_after_infra:
                    raise RolloutsFailing(self.infra_streak, self.infra_causes)
                if self.filtered_streak >= self.give_up_after_groups:
                    raise NoUsableGroups(self.filtered_streak, self.filtered_reasons)
                fresh = [g for g in self.ready if g.version >= version - self.async_steps]
                self.stats.groups_stale += len(self.ready) - len(fresh)
                self.ready = fresh
                if len(self.ready) >= n:
                    batch, self.ready = self.ready[:n], self.ready[n:]
                    return batch
                self.changed.clear()
                await self.changed.wait()
        finally:
            self.wanted = 0
            self.changed.set()

    def take_stats(self) -> SamplerStats:
        stats, self.stats = self.stats, SamplerStats()
        return stats
