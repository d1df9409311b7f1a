"""Evaluation statistics: pure functions over trajectory records, checkable by hand.

Which records count: every record is one attempt. Attempts that failed on infrastructure
(``not valid``) only enter the infra-failure rate; the episode of a (task, trial) is its
latest valid attempt (highest ``attempt``). An episode whose verifier could not grade
(``verifier_error``: no reward, a malformed one, a timeout, a verifier that needed the
network) is a task problem, not the agent's failure: it is left out of every score (mean
reward, pass rate, pass@k, the domain and difficulty rows) and counted by cause in
``verifier_errors`` / ``verifier_error_causes``. An episode that ended in TMax's own error
(``internal_error``, a bug) is left out of every score too and counted in
``internal_errors`` (by exception type in ``internal_error_types``). ``outcomes`` counts the
episodes of each class (``Trajectory.outcome``: scored, policy_failure, verifier_error,
internal_error) and the attempts that failed on infrastructure; ``graded_with_notes``
the scored episodes whose grade came with a note (``grading_note``);
``contradicted_rewards`` the scored episodes whose reward of 1 the verifier's own test
report contradicted (scored 0, also a ``policy_failures`` cause). Tasks the evaluation
skipped (invalid, no usable image, no solution for the oracle) are listed in ``skipped``
with their reasons and counted in ``skipped_kinds``.

Means and standard errors. Every task weighs the same: ``mean_reward`` is the mean over
tasks of each task's mean over its trials. Its standard error measures how much the score
of a whole evaluation run moves between trials: with K >= 2 trials it is the sample standard
deviation (ddof=1) of the K per-trial means (each the mean over the tasks of that trial),
divided by sqrt(K). With one trial there is no spread between trials, so it is the
standard error over tasks instead (std of the task rewards / sqrt(n_tasks)): an estimate of
how much the score would move on another draw of tasks, larger than the trial-to-trial one.
``se_over`` says which was used. When every task has every trial, ``mean_reward`` equals
the mean of the per-trial means. The same holds for ``pass_rate`` (a trial passes when its
reward >= ``threshold``, 1.0 by default) and for the per-domain and per-difficulty rows.

``pass_at_k``: the unbiased estimator of Chen et al. (2021), averaged over the tasks that
have at least k scored trials (so a task whose every trial had a verifier error is in none).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from tmax.rollout.trajectory import Trajectory, verifier_error_cause

PHASES = ("queue", "start", "agent", "verifier", "total")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` trials drawn without replacement from ``n``
    trials, ``c`` of them passing, passes: ``1 - C(n-c, k) / C(n, k)``, computed as the
    stable product ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def _mean(xs: Iterable[float]) -> float | None:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def _se(xs: list[float]) -> float | None:
    """Standard error of the mean of ``xs`` (sample std, ddof=1); None for fewer than 2."""
    if len(xs) < 2:
        return None
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def _as_trajectory(r: Trajectory | Mapping[str, Any]) -> Trajectory:
    return r if isinstance(r, Trajectory) else Trajectory.from_dict(dict(r))


def final_records(records: Iterable[Trajectory]) -> dict[tuple[str, int], Trajectory]:
    """The latest valid attempt of each (task, trial)."""
    best: dict[tuple[str, int], Trajectory] = {}
    for r in records:
        if not r.valid:
            continue
        key = (r.task, r.trial)
        old = best.get(key)
        if old is None or (r.attempt, r.started_at) >= (old.attempt, old.started_at):
            best[key] = r
    return best


def score_stats(scores: Mapping[tuple[str, int], float]) -> dict[str, Any]:
    """Mean over tasks and its standard error (see the module docstring) of the values
    ``scores[(task, trial)]``."""
    by_task: dict[str, list[float]] = defaultdict(list)
    by_trial: dict[int, list[float]] = defaultdict(list)
    for (task, trial), value in scores.items():
        by_task[task].append(value)
        by_trial[trial].append(value)
    task_means = [sum(v) / len(v) for v in by_task.values()]  # every list has a score
    mean = _mean(task_means)
    if len(by_trial) >= 2:
        se, over = _se([sum(v) / len(v) for v in by_trial.values()]), "trials"
    else:
        se, over = _se(task_means), "tasks"
    return {"mean": mean, "se": se, "se_over": over}


def group_row(final: Mapping[tuple[str, int], Trajectory], threshold: float) -> dict[str, Any]:
    """n tasks and trials, mean reward and pass rate with their standard errors."""
    rewards = {k: r.score for k, r in final.items()}
    passes = {k: float(r.score >= threshold) for k, r in final.items()}
    rs, ps = score_stats(rewards), score_stats(passes)
    return {"n_tasks": len({t for t, _ in final}), "n_trials": len(final),
            "mean_reward": rs["mean"], "reward_se": rs["se"],
            "pass_rate": ps["mean"], "pass_se": ps["se"], "se_over": rs["se_over"]}


def summarize(records: Iterable[Trajectory | Mapping[str, Any]], *,
              threshold: float = 1.0, skipped: Iterable[Any] = ()) -> dict[str, Any]:
    """Statistics of an evaluation's records (``Trajectory`` objects or their dicts);
    ``skipped``: the tasks it skipped (``runner.Skipped`` objects or their dicts)."""
    attempts = [_as_trajectory(r) for r in records]
    episodes = final_records(attempts)
    final = {k: r for k, r in episodes.items() if r.scored}
    problems = sorted((k, r) for k, r in episodes.items()
                      if not r.scored and r.internal_error is None)
    internal = sorted((k, r) for k, r in episodes.items() if r.internal_error is not None)
    pairs = {(r.task, r.trial) for r in attempts}
    infra = [r for r in attempts if not r.valid]
    skips = sorted((s if isinstance(s, Mapping) else s.to_dict() for s in skipped),
                   key=lambda s: (s["kind"], s["task"]))

    overall = group_row(final, threshold)
    by_task: dict[str, list[Trajectory]] = defaultdict(list)
    for (task, _), r in sorted(final.items()):
        by_task[task].append(r)
    trials = max((len(v) for v in by_task.values()), default=0)
    pass_k = {}
    for k in range(1, trials + 1):
        vals = [pass_at_k(len(v), sum(r.score >= threshold for r in v), k)
                for v in by_task.values() if len(v) >= k]
        pass_k[k] = _mean(vals)

    def grouped(key) -> dict[str, dict[str, Any]]:
        groups: dict[str, dict] = defaultdict(dict)
        for pair, r in final.items():
            groups[key(r) or "-"][pair] = r
        return {name: group_row(g, threshold) for name, g in sorted(groups.items())}

    timings = {p: _mean(r.timings[p] for r in episodes.values() if p in r.timings)
               for p in PHASES}
    ends = [r.started_at + r.timings.get("total", 0.0) for r in attempts]
    return {
        **overall,
        "threshold": threshold,
        "policies": sorted({r.policy for r in attempts}),
        "trials": trials,
        "pass_at_k": pass_k,
        "by_domain": grouped(lambda r: r.domain),
        "by_difficulty": grouped(lambda r: r.difficulty),
        "episodes": len(episodes),
        "scored_episodes": len(final),
        "attempts": len(attempts),
        "unscored": sorted(f"{t}#{k}" for t, k in pairs - episodes.keys()),
        "infra_failures": len(infra),
        "infra_failure_rate": len(infra) / len(attempts) if attempts else 0.0,
        "infra_causes": dict(Counter((r.infra_failure or {}).get("cause", "infra")
                                     for r in infra)),
        "verifier_errors": len(problems),
        "verifier_error_causes": dict(Counter(verifier_error_cause(r.verifier_error or "")
                                              for _, r in problems)),
        "verifier_error_episodes": [f"{t}#{k}: {r.verifier_error}" for (t, k), r in problems],
        "internal_errors": len(internal),
        "internal_error_types": dict(Counter((r.internal_error or {}).get("error", "?")
                                             for _, r in internal)),
        "internal_error_episodes": [f"{t}#{k}: {(r.internal_error or {}).get('message')}"
                                    for (t, k), r in internal],
        "outcomes": dict(Counter(r.outcome for r in episodes.values()))
        | ({"infra_failure": len(infra)} if infra else {}),
        "graded_with_notes": sum(1 for r in final.values() if r.grading_note),
        "contradicted_rewards": sum(1 for r in final.values() if r.contradicted_reward),
        "skipped": skips,
        "skipped_kinds": dict(Counter(s["kind"] for s in skips)),
        "policy_failures": dict(Counter(r.policy_failure for r in final.values()
                                        if r.policy_failure)),
        "mean_steps": _mean(r.steps for r in episodes.values()),
        "timings": timings,
        "wall_s": max(ends) - min(r.started_at for r in attempts) if attempts else 0.0,
    }


# ---- text tables


def _f(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pm(mean: float | None, se: float | None) -> str:
    return _f(mean) + ("" if se is None else f" ± {se:.3f}")


def _table(title: str, rows: Mapping[str, Mapping[str, Any]]) -> list[str]:
    width = max([len(title), *map(len, rows)])
    lines = [f"{title:{width}}  TASKS  TRIALS  MEAN REWARD      PASS RATE"]
    for name, r in rows.items():
        lines.append(f"{name:{width}}  {r['n_tasks']:5}  {r['n_trials']:6}  "
                     f"{_pm(r['mean_reward'], r['reward_se']):15}  "
                     f"{_pm(r['pass_rate'], r['pass_se'])}")
    return lines


def format_tables(summary: Mapping[str, Any]) -> str:
    """The summary as plain-text tables."""
    s = summary
    over = "trials" if s["se_over"] == "trials" else "tasks (one trial)"
    lines = [
        (f"policy {', '.join(s['policies']) or '-'}: {s['n_tasks']} tasks x {s['trials']} "
         f"trials, {s['episodes']} episodes, {s['attempts']} attempts, {s['wall_s']:.1f}s"),
        f"mean reward  {_pm(s['mean_reward'], s['reward_se'])}   (± SE over {over})",
        f"pass rate    {_pm(s['pass_rate'], s['pass_se'])}   (reward >= {s['threshold']:g})",
        "pass@k       " + ("  ".join(f"@{k} {_f(v)}" for k, v in s["pass_at_k"].items())
                           or "-"),
        (f"infra failures {s['infra_failures']}/{s['attempts']} attempts "
         f"({100 * s['infra_failure_rate']:.1f}%)")
        + (": " + ", ".join(f"{c} {n}" for c, n in s["infra_causes"].items())
           if s["infra_causes"] else ""),
        f"verifier errors {s['verifier_errors']}/{s['episodes']} episodes (task problems, "
        "not scored)" + (": " + ", ".join(f"{c} {n}" for c, n in
                                          s["verifier_error_causes"].items())
                         if s["verifier_errors"] else ""),
        f"internal errors {s['internal_errors']}/{s['episodes']} episodes (TMax's own, not "
        "scored)" + (": " + ", ".join(f"{c} {n}" for c, n in
                                      s["internal_error_types"].items())
                     if s["internal_errors"] else ""),
        "policy failures " + (", ".join(f"{c} {n}" for c, n in
                                        sorted(s["policy_failures"].items())) or "none"),
        "mean seconds " + "  ".join(f"{p} {_f(v, 2)}" for p, v in s["timings"].items()),
    ]
    if s["unscored"]:
        lines.append(f"UNSCORED (only infra failures): {', '.join(s['unscored'])}")
    if s["skipped"]:
        lines.append(f"SKIPPED {len(s['skipped'])} tasks: "
                     + ", ".join(f"{k} {n}" for k, n in s["skipped_kinds"].items()))
        lines += [f"  {k['task']} [{k['kind']}]: "
                  + (k["reason"].strip().splitlines() or [""])[0] for k in s["skipped"]]
    lines += ["", *_table("DOMAIN", s["by_domain"]), "",
              *_table("DIFFICULTY", s["by_difficulty"])]
    return "\n".join(lines)


__all__ = ["PHASES", "final_records", "format_tables", "group_row", "pass_at_k",
           "score_stats", "summarize", "verifier_error_cause"]
