"""`tmax audit`: probe every task, ask the LLM auditor about what the probes cannot prove,
append one record per task to ``OUT/audit.jsonl``.

A record (``AuditRecord``) holds the label, who gave it (``probes``, ``auditor``, or None
when no one could), the probes' findings and evidence, the auditor's rationale, the sandbox
seconds it cost and the task folder's digest. A rerun with the same ``OUT`` skips tasks
whose folder did not change since their record (and re-audits those that failed on
infrastructure); a record is one line, appended whole and fsynced, a torn last line is
dropped on the next start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sandfleet import InfraError
from tmax.audit.probes import Prober, ProbeReport
from tmax.images.store import tree_digest
from tmax.rollout.run import plan_errors
from tmax.tasks.model import Task

log = logging.getLogger(__name__)
RECORDS = "audit.jsonl"


@dataclass
class AuditRecord:
    """The audit of one task (one line of audit.jsonl)."""

    task: str
    path: str
    digest: str
    label: str | None
    labelled_by: str | None
    findings: list[dict[str, str]] = field(default_factory=list)
    probes: dict[str, Any] = field(default_factory=dict)
    rationale: str = ""
    auditor: dict[str, Any] | None = None
    sandbox_s: float = 0.0
    sandboxes: int = 0
    wall_s: float = 0.0
    error: str = ""
    image: str = ""
    """The digest of the image the probes ran in (a rebuilt image is audited again)."""
    audited_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AuditRecord:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def task_digest(task: Task) -> str:
    return tree_digest(task.root)


def read_records(path: str | Path) -> dict[str, AuditRecord]:
    """The latest record of each task in an audit.jsonl (unparsable lines skipped)."""
    records: dict[str, AuditRecord] = {}
    path = Path(path)
    if not path.is_file():
        return records
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            record = AuditRecord.from_dict(json.loads(line))
        except (ValueError, TypeError) as e:
            log.warning("%s line %d: not an audit record (%s); skipped", path, n, e)
            continue
        records[record.task] = record
    return records


def read_all_records(folder: str | Path) -> dict[str, AuditRecord]:
    """The newest record of each task over a folder's audit*.jsonl (all shards)."""
    records: dict[str, AuditRecord] = {}
    for path in sorted(Path(folder).glob("audit*.jsonl")):
        for task, record in read_records(path).items():
            if task not in records or record.audited_at >= records[task].audited_at:
                records[task] = record
    return records


def append_record(path: Path, record: AuditRecord) -> None:
    append_record_line(path, record.to_dict())


def append_record_line(path: Path, data: dict[str, Any]) -> None:
    """One JSON line appended whole and fsynced (a kill leaves at most a torn last line)."""
    line = json.dumps(data, default=str) + "\n"
    with path.open("a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def cut_torn_tail(path: Path) -> None:
    """Drop an unterminated last line (a record cut by a kill), so appends stay lines."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        log.warning("%s: dropping a torn last record (%d bytes)", path, len(data) - keep)
        with path.open("rb+") as f:
            f.truncate(keep)


def record_of(task: Task, report: ProbeReport, digest: str) -> AuditRecord:
    label = report.label
    return AuditRecord(task=task.task_id, path=str(task.root), digest=digest, label=label,
                       labelled_by="probes" if label else None,
                       findings=[asdict(f) for f in report.findings], probes=report.probes,
                       sandbox_s=report.sandbox_s, sandboxes=report.sandboxes,
                       wall_s=report.wall_s, error=report.error)


class Auditor:
    """Audits tasks into ``out/audit.jsonl``: the probes, then (with a teacher) the LLM
    auditor for tasks the probes leave unlabelled."""

    def __init__(self, prober: Prober, out: str | Path, *, teacher: Any = None,
                 config: Any = None, records_name: str = RECORDS):
        self.prober, self.out = prober, Path(out)
        self.teacher, self.config = teacher, config
        self.path = self.out / records_name
        self.out.mkdir(parents=True, exist_ok=True)
        cut_torn_tail(self.path)
        self.done = read_records(self.path)

    def current(self, task: Task, digest: str, image: str) -> AuditRecord | None:
        """The task's record when neither the task folder nor its image changed since."""
        old = self.done.get(task.task_id)
        if old is None or old.error or old.digest != digest or old.image != image:
            return None
        return old

    async def audit(self, task: Task) -> AuditRecord:
        """The task's record: the one on file when current (asking the teacher now about
        an unlabelled one it was not asked about), else a new audit. Never raises."""
        try:
            digest = await asyncio.to_thread(task_digest, task)
            image = await asyncio.to_thread(self._image, task)
            old = self.current(task, digest, image)
            if old is not None and (self.teacher is None or old.label is not None
                                    or old.auditor is not None):
                return old
            if old is not None:
                record = AuditRecord.from_dict(old.to_dict())
            else:
                record = record_of(task, await self.prober.run(task), digest)
                record.image = image
            if self.teacher is not None and record.label is None and not record.error:
                await self._ask(task, record)
        except Exception as e:  # one task's failure must not stop the others
            log.exception("%s: the audit failed", task.task_id)
            record = AuditRecord(task.task_id, str(task.root), "", None, None,
                                 error=f"audit failed: {type(e).__name__}: {e}")
        record.audited_at = time.time()
        append_record(self.path, record)
        self.done[task.task_id] = record
        return record

    def _image(self, task: Task) -> str:
        """The digest of the task's current image ("" when there is none: the probes say
        why)."""
        try:
            return str(self.prober.images.entry(task).digest)
        except (InfraError, *plan_errors()):
            return ""

    async def _ask(self, task: Task, record: AuditRecord) -> None:
        from tmax.audit.llm import audit_task
        from tmax.llm.client import StructuredOutputError, TeacherUnavailable

        evidence = {"findings": record.findings, "probes": record.probes}
        try:
            reply = await audit_task(self.teacher, self.config, task, evidence)
        except StructuredOutputError as e:
            record.auditor = {"error": f"no parsable reply: {e}"}
            return
        except TeacherUnavailable as e:
            record.error = f"teacher unavailable: {e}"  # retried by a rerun
            return
        record.label, record.labelled_by = reply.label, "auditor"
        record.rationale = reply.rationale
        record.auditor = {"label": reply.label, "rationale": reply.rationale}

    async def run(self, tasks: Sequence[Task], *, jobs: int = 2, progress: bool = True
                  ) -> list[AuditRecord]:
        from tqdm import tqdm

        bar = tqdm(total=len(tasks), desc="audit", unit="task", disable=not progress,
                   dynamic_ncols=True)
        slots = asyncio.Semaphore(jobs)
        results: dict[str, AuditRecord] = {}

        async def one(task: Task) -> None:
            async with slots:
                record = await self.audit(task)
            results[task.task_id] = record
            bar.set_postfix_str(f"{task.task_id}: {record.label or record.error[:30] or '-'}")
            bar.update()

        try:
            await asyncio.gather(*(one(t) for t in tasks))
        finally:
            bar.close()
        return [results[t.task_id] for t in tasks]


def label_counts(records: Iterable[AuditRecord]) -> dict[str, int]:
    """Label -> tasks; ``unlabelled`` and ``not audited`` (errors) counted apart."""
    counts: Counter[str] = Counter()
    for r in records:
        counts["not audited" if r.error else (r.label or "unlabelled")] += 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def format_audit(records: Sequence[AuditRecord]) -> str:
    lines = [f"{len(records)} tasks audited:"]
    for label, n in label_counts(records).items():
        lines.append(f"  {label:32s} {n:5d}")
    sandbox = sum(r.sandbox_s for r in records)
    if records:
        lines.append(f"probe cost: {sandbox:.1f} sandbox-s in all, "
                     f"{sandbox / len(records):.2f} per task, "
                     f"{sum(r.sandboxes for r in records) / len(records):.1f} sandboxes per "
                     "task")
    for r in records:
        if r.error:
            lines.append(f"  not audited {r.task}: {r.error[:1000]}")
        elif r.label and r.label != "clean":
            why = r.findings[0]["evidence"] if r.findings else r.rationale
            lines.append(f"  {r.label:32s} {r.task}: {why[:200]}")
    return "\n".join(lines)


__all__ = ["RECORDS", "AuditRecord", "Auditor", "append_record", "append_record_line",
           "cut_torn_tail", "format_audit", "label_counts", "read_all_records",
           "read_records", "record_of", "task_digest"]
