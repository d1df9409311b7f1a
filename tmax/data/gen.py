"""Synthetic task generation: seeded axes -> teacher -> native task -> image -> checks.

Per task seed (``run_generation``):

1. **axes**: ``sample_axes(config.axes, seed)``, all recorded in ``metadata.axes``;
2. **parse**: the teacher's reply, parsed strictly as ``TaskReply`` (``Teacher.structured``
   sends unparsable replies back with the parse error, then drops them);
3. **leak**: no file of the environment may be a copy of a test or solution file;
   **validate**: the reply as a native task, written atomically by ``write_task`` into the
   staging folder (``<out>/.work``); TaskError problems go back to the teacher;
4. **build** + **check**: ``ImageBuilds.build``, then its checker on this round's tests and
   solution (the image digest covers only the environment): the image builds, the
   untouched environment scores below 1, the reference solution scores 1;
5. a failure at 3-4 goes back to the teacher with the tail of its error and log, for at most
   ``generation.repair_rounds`` rounds; then the task is dropped with that reason. A task
   that passes is written to ``<out>/tasks/<task_id>``.

Every task ends as one line of ``<out>/records.jsonl`` (outcome kept | dropped | error, the
reason, each stage's outcome and time). A rerun skips seeds already kept or dropped;
``error`` (the teacher endpoint unavailable) is retried. With the teacher's response cache in
``<out>/teacher-cache`` a rerun pays for no reply twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tmax.data.axes import SKILL_SEP, sample_axes
from tmax.data.config import GenConfig
from tmax.data.fixtures import Fixture, FixtureError, render
from tmax.images.build import ImageBuilds
from tmax.images.store import Checks
from tmax.llm import StructuredOutputError, Teacher, TeacherUnavailable, track_usage
from tmax.tasks import FileSpec, Task, TaskConfig, TaskDraft, TaskError, write_task

log = logging.getLogger(__name__)
RECORDS = "records.jsonl"
SUMMARY = "summary.json"
REWARD_RE = re.compile(r"/logs/verifier/reward\.(json|txt)")


def _relative(files: dict[str, str]) -> dict[str, str]:
    for rel in files:
        p = PurePosixPath(rel)
        if not rel or p.is_absolute() or ".." in p.parts:
            raise ValueError(f"file path {rel!r} must be relative, without '..'")
    return files


class TaskReply(BaseModel):
    """The teacher's task, as JSON (keys the prompt asks for; others are ignored)."""

    model_config = ConfigDict(extra="ignore")

    instruction: str = Field(min_length=20)
    difficulty: Literal["easy", "medium", "hard"] = "medium"
    skills: list[str] = Field(default_factory=list)
    dockerfile: str
    environment_files: dict[str, str] = Field(default_factory=dict)
    test_sh: str
    test_files: dict[str, str] = Field(default_factory=dict)
    solve_sh: str
    solution_files: dict[str, str] = Field(default_factory=dict)
    fixtures: list[Fixture] = Field(default_factory=list)
    """Binary inputs made by code (``tmax.data.fixtures``), placed under environment/."""

    @field_validator("dockerfile")
    @classmethod
    def _from(cls, v: str) -> str:
        lines = [line.strip() for line in v.splitlines()
                 if line.strip() and not line.strip().startswith("#")]
        if not lines or not lines[0].upper().startswith(("FROM ", "ARG ")):
            raise ValueError("the Dockerfile must start with a FROM line")
        return v

    @field_validator("test_sh")
    @classmethod
    def _reward(cls, v: str) -> str:
        if not REWARD_RE.search(v):
            raise ValueError("test_sh must write /logs/verifier/reward.json or reward.txt")
        return v

    @field_validator("environment_files", "test_files", "solution_files")
    @classmethod
    def _paths(cls, v: dict[str, str]) -> dict[str, str]:
        return _relative(v)


def task_id_of(seed: int, prefix: str = "gen") -> str:
    return f"{prefix}-{seed:06d}"


def render_fixtures(reply: TaskReply) -> dict[str, bytes]:
    """environment/ path -> bytes of each fixture the reply asks for (``FixtureError``)."""
    return {f"environment/{f.path}": render(f) for f in reply.fixtures}


def draft_of(reply: TaskReply, seed: int, axes: dict[str, str], config: GenConfig,
             fixtures: dict[str, bytes] | None = None) -> TaskDraft:
    """The reply as a native task draft, with every sampled axis in ``metadata.axes`` and
    the rendered ``fixtures`` (``render_fixtures``) among its environment files."""
    g = config.generation
    skills = reply.skills or axes["primitive_skills"].split(SKILL_SEP)
    meta = {"difficulty": reply.difficulty, "domain": axes["domain"],
            "skills": [s for s in skills if s][:12], "axes": axes,
            "source": f"tmax gen (teacher {config.teacher.model})",
            "extra": {"gen_seed": seed}}
    task_config = TaskConfig.model_validate({
        "metadata": meta, "agent": {"timeout_sec": g.agent_timeout_sec},
        "verifier": {"timeout_sec": g.verifier_timeout_sec}})
    files = {"environment/Dockerfile": FileSpec(reply.dockerfile.encode()),
             "tests/test.sh": FileSpec.script(reply.test_sh),
             "solution/solve.sh": FileSpec.script(reply.solve_sh)}
    for folder, extra in (("environment", reply.environment_files),
                          ("tests", reply.test_files), ("solution", reply.solution_files)):
        for rel, text in extra.items():
            rel = rel.removeprefix(f"{folder}/")
            mode = 0o755 if rel.endswith(".sh") else 0o644
            files.setdefault(f"{folder}/{rel}", FileSpec(text.encode(), mode))
    for rel, data in (fixtures or {}).items():
        files[rel] = FileSpec(data, 0o755 if data[:4] == b"\x7fELF" else 0o644)
    return TaskDraft(task_id_of(seed, g.id_prefix), reply.instruction, task_config, files)


LEAK_MIN_BYTES = 8


def leaks(draft: TaskDraft) -> list[str]:
    """Answers left where the agent can read them: a file under environment/ (the image)
    byte-identical to one under tests/ or solution/ (the audit looks deeper)."""
    hidden = {spec.data: rel for rel, spec in draft.files.items()
              if rel.startswith(("tests/", "solution/")) and len(spec.data) >= LEAK_MIN_BYTES}
    return [f"{rel} is a copy of {hidden[spec.data]}, which the agent must not see"
            for rel, spec in sorted(draft.files.items())
            if rel.startswith("environment/") and spec.data in hidden]


@dataclass
class Stage:
    name: str  # parse | fixtures | leak | validate | build | check | write
    ok: bool
    seconds: float
    round: int
    error: str = ""


@dataclass
class Record:
    seed: int
    task_id: str
    axes: dict[str, str]
    outcome: str = "error"  # kept | dropped | error (retried on a rerun)
    reason: str = ""
    rounds: int = 0
    """Teacher rounds (1 = no repair)."""
    parsed: bool = False
    built: bool = False
    checked: bool = False
    kept: bool = False
    stages: list[Stage] = field(default_factory=list)
    seconds: float = 0.0
    teacher: dict[str, Any] = field(default_factory=dict)
    """What this task's teacher calls spent (``tmax.llm.Usage``)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Failure(Exception):
    def __init__(self, stage: str, message: str, tail: str = "", recorded: bool = False):
        self.stage, self.message, self.tail, self.recorded = stage, message, tail, recorded
        super().__init__(f"{stage}: {message}")


_VOLATILE = ((re.compile(r"\bcheck-[0-9a-f]{12}\b"), "check-<id>"),
             (re.compile(r"\[exit (-?\d+), [\d.]+s\]"), r"[exit \1]"),
             (re.compile(r" ?\(log: [^)]*\)"), ""),
             (re.compile(r"\b(rootfs|tmp|build)-[A-Za-z0-9_]{6,}\b"), r"\1-<tmp>"),
             (re.compile(r"(-fd) \d+"), r"\1 <n>"))


def stable_text(text: str) -> str:
    """An error or log without what changes from run to run (sandbox ids, timings, log
    paths): the repair request, hence its cache key, is the same when a run is redone."""
    for pattern, repl in _VOLATILE:
        text = pattern.sub(repl, text)
    return text


def build_output(log_text: str) -> str:
    """A build log without the builder's own script: what follows the last command line
    (``$ ...``) and the blank line that ends its script; the whole log if there is none."""
    lines = log_text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("$ ")]
    if not starts:
        return log_text
    rest = lines[starts[-1] + 1:]
    if "" in rest:
        rest = rest[rest.index("") + 1:]
    return "\n".join(rest)


def _tail(text: str, n: int) -> str:
    return text if len(text) <= n else "...\n" + text[-n:]


def _file_tail(path: Path | None, n: int) -> str:
    try:
        return _tail(path.read_text(errors="replace"), n) if path and path.is_file() else ""
    except OSError:
        return ""


def latest_records(run: Path) -> dict[int, dict[str, Any]]:
    """Seed -> its latest record over ``run/records*.jsonl`` (every shard)."""
    found: dict[int, dict[str, Any]] = {}
    for path in sorted(Path(run).glob("records*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash
            found[int(r["seed"])] = r
    return found


class Generator:
    """One generation run into ``out`` (see the module docstring)."""

    def __init__(self, config: GenConfig, out: str | Path, builds: ImageBuilds, *,
                 teacher: Teacher | None = None, shard: tuple[int, int] | None = None):
        """``shard`` = (k, n): this process runs the seeds with ``seed % n == k`` and writes
        its own records file (a Slurm array task per shard shares ``out``)."""
        if shard is not None and not 0 <= shard[0] < shard[1]:
            raise ValueError(f"shard {shard[0]}/{shard[1]}: need 0 <= k < n")
        self.config, self.out, self.builds, self.shard = config, Path(out), builds, shard
        self.records_path = self.out / (RECORDS if shard is None else
                                        f"records.shard-{shard[0]}-of-{shard[1]}.jsonl")
        self.teacher = teacher or Teacher(config.teacher, cache_dir=config.teacher.cache_dir
                                          or self.out / "teacher-cache")
        self.tasks_dir, self.work_dir = self.out / "tasks", self.out / ".work"
        if builds.checker is None:
            raise ValueError("generation needs ImageBuilds with a checker (image_checker)")

    # ------------------------------------------------------------------ records

    def records(self) -> dict[int, dict[str, Any]]:
        """The latest record of each seed in ``records*.jsonl`` (all shards)."""
        return latest_records(self.out)

    def _append(self, record: Record) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.records_path, "a") as f:
            f.write(json.dumps(record.to_dict()) + "\n")
            f.flush()
            os.fsync(f.fileno())

    # ------------------------------------------------------------------ one task

    async def generate(self, seed: int) -> Record:
        """One task seed through every stage; always returns its record (and writes it)."""
        start = time.monotonic()
        axes = sample_axes(self.config.axes, seed)
        record = Record(seed, task_id_of(seed, self.config.generation.id_prefix), axes)
        with track_usage() as usage:
            try:
                await self._rounds(record)
            except TeacherUnavailable as e:
                record.outcome, record.reason = "error", f"teacher unavailable: {e}"
            finally:
                record.teacher = usage.to_dict()
                record.seconds = round(time.monotonic() - start, 2)
                shutil.rmtree(self.work_dir / record.task_id, ignore_errors=True)
                self._append(record)
        return record

    async def _rounds(self, record: Record) -> None:
        p, g = self.config.prompts, self.config.generation
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": p.system},
            {"role": "user", "content": p.task.format(seed=record.seed, **record.axes)}]
        for round_ in range(1, g.repair_rounds + 2):
            record.rounds = round_
            t0 = time.monotonic()
            try:
                reply, conversation = await self.teacher.structured(messages, TaskReply)
            except StructuredOutputError as e:
                record.stages.append(Stage("parse", False, _since(t0), round_, e.errors[-1]))
                record.outcome = "dropped"
                record.reason = f"unparsable: {e.errors[-1][:300]}"
                return
            record.stages.append(Stage("parse", True, _since(t0), round_))
            record.parsed = True
            try:
                await self._attempt(record, reply, round_)
                record.outcome, record.kept = "kept", True
                return
            except _Failure as f:
                if not f.recorded:
                    record.stages.append(Stage(f.stage, False, 0.0, round_, f.message[:500]))
                record.reason = f"{f.stage}: {f.message[:300]}"
                error = _tail(stable_text(f"{f.message}\n{f.tail}").strip(), g.error_tail_chars)
                messages = [*conversation, {"role": "user", "content": p.repair.format(
                    stage=f.stage, error=error)}]
        record.outcome = "dropped"
        record.reason = f"after {g.repair_rounds} repair rounds: {record.reason}"

    async def _attempt(self, record: Record, reply: TaskReply, round_: int) -> None:
        """Write, build and check one reply; ``_Failure`` naming the stage otherwise."""
        t0 = time.monotonic()
        try:
            fixtures = await asyncio.to_thread(render_fixtures, reply)
        except FixtureError as e:
            raise _Failure("fixtures", str(e)) from None
        draft = draft_of(reply, record.seed, record.axes, self.config, fixtures)
        if found := leaks(draft):
            raise _Failure("leak", "; ".join(found))
        try:
            task = await asyncio.to_thread(write_task, draft, self.work_dir, overwrite=True)
        except TaskError as e:
            raise _Failure("validate", str(e)) from None
        record.stages.append(Stage("validate", True, _since(t0), round_))
        t0 = time.monotonic()
        result = await asyncio.to_thread(self.builds.build, task, check=False)
        n = self.config.generation.error_tail_chars
        if result.status == "failed":
            raise _Failure("build", result.error,
                           build_output(_file_tail(Path(result.log) if result.log else None,
                                                   4 * n)))
        record.built = True
        record.stages.append(Stage("build", True, _since(t0), round_))
        t0 = time.monotonic()
        checks = await asyncio.to_thread(self._check, task, round_)
        if not checks.ok:
            record.stages.append(Stage("check", False, _since(t0), round_, checks.reason))
            raise _Failure("check", checks.reason or "no checks ran",
                           _file_tail(self.builds.store.path(checks.log), n), recorded=True)
        record.stages.append(Stage("check", True, _since(t0), round_))
        record.checked = True
        t0 = time.monotonic()
        await asyncio.to_thread(write_task, draft, self.tasks_dir, overwrite=True)
        record.stages.append(Stage("write", True, _since(t0), round_))

    def _check(self, task: Task, round_: int) -> Checks:
        """The initial-state checks of this round's task (its tests and solution may differ
        from those the image was first checked with: the image digest covers only the
        environment), recorded in the store's entry."""
        assert self.builds.checker is not None
        entry = self.builds.store.read().tasks[task.task_id]
        log_rel = f"logs/{task.task_id}-{entry.digest}.gen-r{round_}.checks.log"
        image, verifier = self.builds.sandbox_images(self.builds.plan(task), entry)
        checks = self.builds.checker(task, image, self.builds.store.path(log_rel), verifier)
        checks.log = log_rel
        self.builds.store.update(lambda m: m.tasks.__setitem__(
            task.task_id, m.tasks[task.task_id].model_copy(update={"checks": checks})))
        return checks

    # ------------------------------------------------------------------ the run

    async def run(self, seeds: Iterable[int], *, jobs: int = 2, progress: bool = True
                  ) -> list[dict[str, Any]]:
        """Every seed not yet kept or dropped, ``jobs`` at a time; all seeds' records."""
        from tqdm import tqdm

        seeds = [s for s in seeds if self.shard is None or s % self.shard[1] == self.shard[0]]
        done = {s for s, r in self.records().items() if r["outcome"] in ("kept", "dropped")}
        todo = [s for s in seeds if s not in done]
        slots = asyncio.Semaphore(max(1, jobs))
        counts: Counter[str] = Counter()
        with tqdm(total=len(todo), desc="gen", unit="task", disable=not progress) as bar:
            async def one(seed: int) -> None:
                async with slots:
                    record = await self.generate(seed)
                counts[record.outcome] += 1
                bar.set_postfix(dict(counts))
                bar.update(1)

            async with self.teacher:
                await asyncio.gather(*(one(s) for s in todo))
        records = self.records()
        self._write_summary(records)
        return [records[s] for s in seeds if s in records]

    def _write_summary(self, records: dict[int, dict[str, Any]]) -> None:
        summary = {"usage": self.teacher.usage.to_dict(),
                   "yield": yield_table(list(records.values()))}
        name = SUMMARY if self.shard is None else \
            f"summary.shard-{self.shard[0]}-of-{self.shard[1]}.json"
        tmp = self.out / f".{name}.tmp"
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, self.out / name)


def _since(t0: float) -> float:
    return round(time.monotonic() - t0, 2)


YIELD_COLUMNS = ("attempted", "parsed", "built", "checked", "kept")


def yield_table(records: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Domain (and ``all``) -> attempted / parsed / built / checked / kept counts; records
    of tasks that did not finish (``error``) are not attempts."""
    table: dict[str, dict[str, int]] = {}
    for r in records:
        if r["outcome"] == "error":
            continue
        for key in (r["axes"]["domain"], "all"):
            row = table.setdefault(key, dict.fromkeys(YIELD_COLUMNS, 0))
            row["attempted"] += 1
            for col in YIELD_COLUMNS[1:]:
                row[col] += bool(r[col])
    return dict(sorted(table.items(), key=lambda kv: (kv[0] == "all", kv[0])))


def format_yield(table: dict[str, dict[str, int]]) -> str:
    width = max([len("domain"), *map(len, table)])
    lines = [f"{'domain':{width}}  " + "  ".join(f"{c:>9}" for c in YIELD_COLUMNS)]
    for name, row in table.items():
        lines.append(f"{name:{width}}  " + "  ".join(f"{row[c]:>9}" for c in YIELD_COLUMNS))
    return "\n".join(lines)


def drop_reasons(records: list[dict[str, Any]]) -> Counter[str]:
    """Dropped tasks by the stage of their last failure (parse, validate, build, check)."""
    out: Counter[str] = Counter()
    for r in records:
        if r["outcome"] == "dropped":
            failed = [s["name"] for s in r["stages"] if not s["ok"]]
            out[failed[-1] if failed else "unknown"] += 1
    return out
