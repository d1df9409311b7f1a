"""`tmax repair`: keep, repair or drop each audited task into a clean task folder.

- unlabelled or ``clean``: kept as is;
- ``answer_leak``: repaired without an LLM (``move_leaks``): each file the copy probe proved
  to hold the answer is found among environment/'s files by its content, moved into
  tests/ (which reaches the sandbox only after the agent), its COPY/ADD (or %files) line
  removed, and the verifier's references to its image path rewritten to /tests/<name>;
- ``verifier_too_weak`` found by the exploit probes alone: hardened without an LLM where a
  sound mechanical fix exists (``tmax.audit.harden``: grading from pytest's report rather
  than its exit status, the runner isolated from the working directory), else the teacher
  (when there is one) or dropped with the reason;
- ``verifier_too_weak``, ``instruction_verifier_mismatch``: the teacher rewrites tests/
  (and the instruction), with the reason of a rejected attempt sent back, for
  ``rounds`` attempts; with no teacher they are dropped;
- any other label: dropped.

A repair is kept only when the rebuilt task passes its build-time checks (oracle 1,
untouched below 1) and the probes, run again on the rebuilt image, find nothing: the probe
that flagged it now fails. Otherwise the task is dropped with the reason. Each kept task is
written whole to CLEAN/tasks/<id> (a temporary folder, then rename); CLEAN/repair.jsonl gets
one record per task, so a rerun skips what is done.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import posixpath
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tmax.audit import harden
from tmax.audit.labels import FIXABLE
from tmax.audit.probes import Prober
from tmax.audit.run import AuditRecord, append_record_line, cut_torn_tail
from tmax.tasks.model import Task, TaskError
from tmax.tasks.native import load_task

log = logging.getLogger(__name__)
REPAIRS = "repair.jsonl"
TEACHER_LABELS = ("verifier_too_weak", "instruction_verifier_mismatch")


class RepairFailed(Exception):
    """A repair that could not be made or did not hold; the task is dropped with it."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class RepairUnfinished(Exception):
    """A repair stopped by something outside the task (the teacher or the fleet
    unavailable): recorded as ``error`` and tried again by a rerun, never a drop."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class RepairRecord:
    """What happened to one task (one line of repair.jsonl)."""

    task: str
    digest: str
    before: str | None
    action: str
    """kept | repaired | dropped | error (not finished: a rerun tries again)"""
    after: str | None = None
    reason: str = ""
    changes: list[str] = field(default_factory=list)
    attempts: int = 0
    sandbox_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------ answer leaks


def leaked_files(record: AuditRecord) -> dict[str, str]:
    """Image path -> sha256 of each file the copy probe proved to leak the answer."""
    proven = {run["file"] for run in record.probes.get("copy", [])
              if run.get("reward") is not None and run["reward"] >= 1.0}
    shas = {c["path"]: c["sha256"] for c in record.probes.get("leak_scan", {})
            .get("candidates", [])}
    return {path: shas[path] for path in sorted(proven) if path in shas}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _drop_from_definition(definition: Path, rel: str) -> bool:
    """Remove ``rel`` (a source path relative to environment/) from the COPY/ADD lines of a
    Dockerfile or the %files lines of a container.def; a line left with no source goes.
    True when the file changed."""
    text = definition.read_text()
    out, hit = [], False
    in_files = False
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if definition.name != "Dockerfile":
            if stripped.startswith("%"):
                in_files = stripped.split()[0] == "%files"
            elif in_files and stripped and _norm(stripped.split()[0]) == rel:
                hit = True
                continue
            out.append(line)
            continue
        words = stripped.split()
        if words and words[0].upper() in ("COPY", "ADD") and not stripped.endswith("\\") \
                and not any(w.startswith(("[", "--from")) for w in words):
            flags = [w for w in words[1:] if w.startswith("--")]
            paths = [w for w in words[1:] if not w.startswith("--")]
            sources, dest = paths[:-1], paths[-1:] if paths else []
            keep = [s for s in sources if _norm(s) != rel]
            if len(keep) != len(sources):
                hit = True
                if not keep:
                    continue
                line = " ".join([words[0], *flags, *keep, *dest]) + "\n"
        out.append(line)
    if hit:
        _write(definition, "".join(out))
    return hit


def _norm(source: str) -> str:
    return posixpath.normpath(source.removeprefix("./") or ".")


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.chmod(tmp, path.stat().st_mode & 0o7777 if path.exists() else 0o644)
    os.replace(tmp, path)


def move_leaks(root: Path, leaks: dict[str, str]) -> list[str]:
    """Repair an answer leak in the task folder ``root`` (a copy): see the module doc. The
    changes made, one line each; ``RepairFailed`` when a leaked file is not a file of
    environment/ (a build step makes it: no deterministic repair)."""
    env, tests = root / "environment", root / "tests"
    files = [p for p in env.rglob("*") if p.is_file() and not p.is_symlink()]
    definitions = [env / n for n in ("Dockerfile", "container.def") if (env / n).is_file()]
    changes = []
    for image_path, sha in leaks.items():
        origins = [p for p in files if p.exists() and _sha(p) == sha]
        if not origins:
            raise RepairFailed(f"{image_path} holds the answer but is not a file of "
                               "environment/ (a build step makes it): no deterministic repair")
        name = Path(image_path).name
        target = tests / name
        if target.exists() and _sha(target) != sha:
            target = tests / f"leaked-{name}"
        for origin in origins:
            rel = str(origin.relative_to(env))
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, target)
                changes.append(f"moved environment/{rel} to tests/{target.name}")
            else:
                changes.append(f"removed environment/{rel} (tests/{target.name} holds it)")
            origin.unlink()
            folder = origin.parent
            while folder != env and not any(folder.iterdir()):  # no empty folders left
                folder.rmdir()
                folder = folder.parent
            for definition in definitions:
                if _drop_from_definition(definition, rel):
                    changes.append(f"dropped {rel} from environment/{definition.name}")
        pattern = re.compile(r"(?<![\w./-])" + re.escape(image_path) + r"(?![\w.-])")
        for source in sorted(tests.rglob("*")):
            if not source.is_file() or source == target:
                continue
            try:
                text = source.read_text()
            except UnicodeDecodeError:
                continue
            new = pattern.sub(f"/tests/{target.name}", text)
            if new != text:
                _write(source, new)
                changes.append(f"tests/{source.relative_to(tests)}: {image_path} -> "
                               f"/tests/{target.name}")
    return changes


# ------------------------------------------------------------------ the repair loop


def read_repairs(clean: str | Path) -> dict[str, RepairRecord]:
    """The last record of each task over ``clean``'s repair*.jsonl (every shard)."""
    done: dict[str, RepairRecord] = {}
    for path in sorted(Path(clean).glob("repair*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                data = json.loads(line)
                done[data["task"]] = RepairRecord(**data)
            except (ValueError, TypeError, KeyError):
                continue  # a torn last line
    return done


class Repairer:
    """Keeps, repairs or drops audited tasks into ``clean``: see the module doc."""

    def __init__(self, prober: Prober, builds: Any, clean: str | Path, *,
                 teacher: Any = None, config: Any = None, rounds: int = 2,
                 records_name: str = REPAIRS):
        """``records_name``: this run's records file in ``clean`` (a shard's own); what is
        done is read from every ``repair*.jsonl`` there."""
        self.prober, self.builds = prober, builds
        self.clean = Path(clean)
        self.teacher, self.config, self.rounds = teacher, config, rounds
        self.tasks_dir = self.clean / "tasks"
        self.work = self.clean / ".work"
        self.tasks_dir.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(exist_ok=True)
        self.path = self.clean / records_name
        cut_torn_tail(self.path)
        self.done: dict[str, RepairRecord] = read_repairs(self.clean)

    async def handle(self, task: Task, audit: AuditRecord) -> RepairRecord:
        old = self.done.get(task.task_id)
        if old is not None and old.digest == audit.digest and old.action != "error":
            return old
        label = audit.label
        if audit.error:  # not the task's verdict: a later audit decides
            record = RepairRecord(task.task_id, audit.digest, None, "error",
                                  reason=f"not audited ({audit.error[:200]}); audit again")
        elif label in (None, "clean"):
            await asyncio.to_thread(self._publish, task.root, task.task_id)
            record = RepairRecord(task.task_id, audit.digest, label, "kept", after=label)
        elif label not in FIXABLE:
            record = RepairRecord(task.task_id, audit.digest, label, "dropped",
                                  reason=f"{label}: not repaired (only "
                                         f"{', '.join(FIXABLE)} are)")
        elif label == "verifier_too_weak" and harden.exploit_only(audit):
            record = await self._harden(task, audit)  # mechanical first: no teacher needed
            if record.action == "dropped" and self.teacher is not None:
                mechanical = record.reason
                record = await self._repair(task, audit)
                if record.action == "dropped":
                    record.reason = f"{mechanical}; the teacher's: {record.reason}"
        elif label in TEACHER_LABELS and self.teacher is None:
            record = RepairRecord(task.task_id, audit.digest, label, "dropped",
                                  reason=f"{label}: needs a teacher to repair (--config "
                                         "with a teacher endpoint)")
        else:
            record = await self._repair(task, audit)
        append_record_line(self.path, record.to_dict())
        self.done[task.task_id] = record
        return record

    async def _repair(self, task: Task, audit: AuditRecord) -> RepairRecord:
        label = audit.label
        assert label is not None
        record = RepairRecord(task.task_id, audit.digest, label, "dropped")
        feedback: str | None = None
        rounds = 1 if label == "answer_leak" else self.rounds
        for attempt in range(1, rounds + 1):
            record.attempts = attempt
            work = Path(tempfile.mkdtemp(prefix=f"{task.task_id}-", dir=self.work))
            root = work / task.task_id
            try:
                shutil.copytree(task.root, root, symlinks=True)
                if label == "answer_leak":
                    leaks = leaked_files(audit)
                    if not leaks:
                        raise RepairFailed("no file proven to leak by the copy probe (the "
                                           "label is the auditor's): nothing to move")
                    changes = await asyncio.to_thread(move_leaks, root, leaks)
                else:
                    changes = await self._teacher_repair(task, audit, root, feedback)
                if not changes:
                    raise RepairFailed("the repair changed nothing")
                record.changes = changes
                await self._check(root, record, audit)
                await asyncio.to_thread(self._publish, root, task.task_id)
                record.action, record.reason = "repaired", ""
                return record
            except RepairFailed as e:
                record.reason = feedback = e.reason
                log.info("%s: repair attempt %d rejected: %s", task.task_id, attempt, e.reason)
            except RepairUnfinished as e:
                record.action, record.reason = "error", f"{e.reason}; rerun to try again"
                log.warning("%s: repair not finished: %s", task.task_id, e.reason)
                return record
            except (OSError, shutil.Error) as e:  # the task's files cannot be copied or moved
                record.reason = f"the task's files: {e}"
                return record
            finally:
                shutil.rmtree(work, ignore_errors=True)
        return record

    async def _harden(self, task: Task, audit: AuditRecord) -> RepairRecord:
        """Harden ``task``'s verifier mechanically (``tmax.audit.harden``): repaired and
        published when the oracle still scores 1, the untouched environment 0 and no probe
        (the exploits included) finds anything; else dropped with the reason, the original
        untouched and still labelled."""
        record = RepairRecord(task.task_id, audit.digest, audit.label, "dropped", attempts=1)
        hacks = harden.working_hacks(audit)
        work = Path(tempfile.mkdtemp(prefix=f"{task.task_id}-", dir=self.work))
        root = work / task.task_id
        try:
            shutil.copytree(task.root, root, symlinks=True)
            tests = root / "tests"
            fixes = harden.plan(tests, hacks, steps=bool(task.steps))
            changes: list[str] = []
            if "isolate" in fixes:
                changes += harden.isolate(tests)
            if "report" in fixes:
                changes += harden.add_report(tests)
                changes.append(harden.set_counts(tests, *await self._reference_counts(root)))
            record.changes = changes
            await self._check(root, record, audit)
            entry = self.builds.store.read().tasks.get(task.task_id)
            nop = entry.checks.nop_reward if entry is not None and entry.checks else None
            if nop != 0.0:
                raise RepairFailed(f"the untouched environment scores {nop} after the "
                                   "hardening, not 0")
            await asyncio.to_thread(self._publish, root, task.task_id)
            record.action, record.reason = "repaired", ""
        except harden.NotHardened as e:  # nothing was tried
            record.after, record.attempts = audit.label, 0
            record.reason = (f"verifier_too_weak ({', '.join(hacks) or 'exploit'}): no "
                             f"mechanical hardening: {e}")
        except RepairFailed as e:
            record.after = audit.label
            record.reason = f"the hardening did not hold (the original is kept): {e.reason}"
        except RepairUnfinished as e:
            record.action, record.reason = "error", f"{e.reason}; rerun to try again"
        except (OSError, shutil.Error) as e:
            record.reason = f"the task's files: {e}"
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return record

    async def _reference_counts(self, root: Path) -> tuple[int, int]:
        """Build the gated copy (counts 0); the reference run's ``(tests, passed)`` from its
        build-time checks' oracle run."""
        try:
            gated = load_task(root)
        except TaskError as e:
            raise RepairFailed(f"the hardened task does not validate: {e}") from None
        built = await asyncio.to_thread(self.builds.build, gated)
        if built.status == "failed":
            raise RepairFailed(f"the hardened image does not build: {built.error}")
        checks = built.checks or {}
        if not checks.get("ok", False) or not checks.get("log"):
            raise RepairFailed("the hardened task fails its build-time checks: "
                               f"{checks.get('reason') or 'no checks log'}")
        text = await asyncio.to_thread(
            self.builds.store.path(checks["log"]).read_text, errors="replace")
        return harden.reference_counts(text)

    async def _teacher_repair(self, task: Task, audit: AuditRecord, root: Path,
                              feedback: str | None) -> list[str]:
        from tmax.audit.llm import RepairRejected, apply_repair, repair_task
        from tmax.llm.client import StructuredOutputError, TeacherUnavailable

        evidence = {"findings": audit.findings, "probes": audit.probes}
        try:
            reply = await repair_task(self.teacher, self.config, task, audit.label or "",
                                      evidence, feedback)
            written = await asyncio.to_thread(apply_repair, root, reply, audit.label or "")
        except TeacherUnavailable as e:
            raise RepairUnfinished(f"the teacher is unavailable: {e}") from None
        except (StructuredOutputError, RepairRejected) as e:
            raise RepairFailed(f"the teacher's repair was not usable: {e}") from None
        return [f"rewrote {path}" for path in written]

    async def _check(self, root: Path, record: RepairRecord, audit: AuditRecord) -> None:
        """Rebuild and re-probe the repaired copy at ``root``; ``RepairFailed`` unless it
        passes the build-time checks and no probe faults it, and, for a label the auditor
        gave (no probe proved it), unless the auditor now calls it clean."""
        try:
            repaired = load_task(root)
        except TaskError as e:
            raise RepairFailed(f"the repaired task does not validate: {e}") from None
        built = await asyncio.to_thread(self.builds.build, repaired)
        if built.status == "failed":
            raise RepairFailed(f"the repaired image does not build: {built.error}")
        checks = built.checks or {}  # run again for new tests/ on a reused image
        if checks and not checks.get("ok", False):
            raise RepairFailed(f"the repaired task fails its build-time checks: "
                               f"{checks.get('reason')}")
        report = await self.prober.run(repaired)
        record.sandbox_s += report.sandbox_s
        if report.error:
            raise RepairUnfinished(f"the repaired task could not be probed: {report.error}")
        record.after = report.label
        if report.label is not None:
            raise RepairFailed(f"after the repair the probes still find {report.label}: "
                               + "; ".join(f.evidence for f in report.findings)[:600])
        if audit.labelled_by == "auditor":
            await self._ask_again(repaired, report, record)

    async def _ask_again(self, repaired: Task, report: Any, record: RepairRecord) -> None:
        from tmax.audit.llm import audit_task
        from tmax.llm.client import StructuredOutputError, TeacherUnavailable

        if self.teacher is None:
            raise RepairFailed("the label was the auditor's: only the auditor can clear it")
        evidence = {"findings": [], "probes": report.probes}
        try:
            reply = await audit_task(self.teacher, self.config, repaired, evidence)
        except TeacherUnavailable as e:
            raise RepairUnfinished(f"the teacher is unavailable: {e}") from None
        except StructuredOutputError as e:
            raise RepairFailed(f"the auditor gave no parsable verdict on the repair: {e}") \
                from None
        record.after = reply.label
        if reply.label != "clean":
            raise RepairFailed(f"after the repair the auditor says {reply.label}: "
                               f"{reply.rationale[:400]}")

    def _publish(self, src: Path, task_id: str) -> None:
        """Copy ``src`` whole to CLEAN/tasks/<id> (temporary folder, then rename)."""
        dest = self.tasks_dir / task_id
        tmp = self.tasks_dir / f".{task_id}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp, symlinks=True)
        if dest.exists():
            old = self.tasks_dir / f".{task_id}.{os.getpid()}.old"
            os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)

    async def run(self, pairs: Sequence[tuple[Task, AuditRecord]], *, jobs: int = 1,
                  progress: bool = True) -> list[RepairRecord]:
        from tqdm import tqdm

        bar = tqdm(total=len(pairs), desc="repair", unit="task", disable=not progress,
                   dynamic_ncols=True)
        slots = asyncio.Semaphore(jobs)
        results: dict[str, RepairRecord] = {}

        async def one(task: Task, audit: AuditRecord) -> None:
            async with slots:
                results[task.task_id] = await self.handle(task, audit)
            bar.update()

        try:
            await asyncio.gather(*(one(t, a) for t, a in pairs))
        finally:
            bar.close()
            shutil.rmtree(self.work, ignore_errors=True)
        return [results[t.task_id] for t, _ in pairs]


__all__ = ["REPAIRS", "RepairFailed", "RepairRecord", "RepairUnfinished", "Repairer",
           "leaked_files", "move_leaks", "read_repairs"]
