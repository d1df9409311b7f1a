"""Decontamination: word n-gram overlap of task instructions against benchmark tasks.

Tokens are lower-cased alphanumeric runs (``[a-z0-9]+``); an instruction is contaminated at
``n`` when one of its word n-grams appears in a benchmark instruction. The report gives, per
task and per ``n`` (13 and 8 by default), the number of its n-grams found in the benchmarks,
the fraction of its n-grams that is, and which benchmark tasks they came from.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tmax.tasks import TaskError, find_tasks, read_any

TOKEN_RE = re.compile(r"[a-z0-9]+")
NS: tuple[int, ...] = (13, 8)

Ngram = tuple[str, ...]


def tokens(text: str) -> list[str]:
    return TOKEN_RE.findall(text.lower())


def ngrams(words: Sequence[str], n: int) -> set[Ngram]:
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


@dataclass
class Index:
    """Benchmark n-grams: ``by_n[n][ngram]`` = the benchmark task ids holding it."""

    by_n: dict[int, dict[Ngram, set[str]]] = field(default_factory=dict)
    tasks: int = 0

    def add(self, task_id: str, text: str, ns: Iterable[int] = NS) -> None:
        words = tokens(text)
        for n in ns:
            table = self.by_n.setdefault(n, {})
            for g in ngrams(words, n):
                table.setdefault(g, set()).add(task_id)
        self.tasks += 1


def instructions(*folders: str | Path) -> dict[str, str]:
    """Task id -> instruction of every task (any supported layout) under ``folders``."""
    found: dict[str, str] = {}
    for path in find_tasks(*folders):
        try:
            found[path.name] = read_any(path).instruction
        except (TaskError, OSError, ValueError):
            continue  # an unreadable benchmark task has no instruction to match
    return found


def build_index(*folders: str | Path, ns: Iterable[int] = NS) -> Index:
    index = Index()
    for task_id, text in sorted(instructions(*folders).items()):
        index.add(task_id, text, tuple(ns))
    return index


@dataclass
class Overlap:
    n: int
    ngrams: int
    """The instruction's distinct n-grams."""
    hits: int
    """Of them, those found in a benchmark."""
    matches: list[str]
    """Benchmark tasks sharing at least one n-gram."""

    @property
    def fraction(self) -> float:
        return self.hits / self.ngrams if self.ngrams else 0.0


def overlap(text: str, index: Index, n: int) -> Overlap:
    grams = ngrams(tokens(text), n)
    table = index.by_n.get(n, {})
    found = [g for g in grams if g in table]
    matches = sorted({t for g in found for t in table[g]})
    return Overlap(n, len(grams), len(found), matches)


@dataclass
class Row:
    task_id: str
    overlaps: dict[int, Overlap]
    contaminated: bool

    def to_dict(self) -> dict:
        return {"task_id": self.task_id, "contaminated": self.contaminated,
                **{f"n{n}": asdict(o) | {"fraction": round(o.fraction, 4)}
                   for n, o in self.overlaps.items()}}


def report(tasks: dict[str, str], index: Index, ns: Iterable[int] = NS,
           flag_n: int = 13) -> list[Row]:
    """One row per task; ``contaminated`` when any ``flag_n``-gram is in the benchmarks."""
    rows = []
    for task_id, text in sorted(tasks.items()):
        overlaps = {n: overlap(text, index, n) for n in ns}
        hit = overlaps.get(flag_n) or overlap(text, index, flag_n)
        rows.append(Row(task_id, overlaps, hit.hits > 0))
    return rows
