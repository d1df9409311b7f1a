"""The LLM auditor and repairer of ``tmax audit``: a teacher labels what the probes cannot
prove, and rewrites the verifier (and the instruction) of a task the audit can fix.

- ``load_audit_config`` reads configs/audit.yaml (strict): the teacher, the probe limits, how
  much task text the teacher sees, and the prompts, each a ``str.format`` template whose
  fields (``PROMPT_FIELDS``) are checked at load time.
- ``task_context`` renders a task as text: instruction.md, task.toml, then every file of
  environment/, tests/ and solution/ headed by its path; binaries and links by name only;
  cut to a budget shared fairly between the files, each cut shown as ``[... N chars cut]``.
- ``audit_task`` asks the teacher for one ``AuditorReply`` (label and rationale) given the
  task and the probes' evidence; ``repair_task`` asks for a ``RepairReply`` (new files) for
  ``verifier_too_weak`` or ``instruction_verifier_mismatch``, with the reason a previous
  attempt was rejected when there was one. Replies that do not parse, or name a label or a
  path the audit does not allow, go back to the teacher with the error
  (``Teacher.structured``); ``StructuredOutputError`` and ``TeacherUnavailable`` reach the
  caller. The teacher's cache makes a rerun free.
- ``apply_repair`` writes a reply into a copy of the task, each file atomically, after
  checking every path first (``RepairRejected``: nothing written).

What is covered: the teacher can only write tests/** (and instruction.md for a mismatch) of
the copy it is given; links that lead out of tests/ or the task folder are refused. What is
not: whether the new verifier is right; the caller's probes decide that (oracle passes, nop
fails, the flagging probe now fails) and send the reason back as ``feedback``.
"""

from __future__ import annotations

import asyncio
import json
import os
import string
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tmax.audit.labels import LABELS, Label, describe
from tmax.audit.settings import ProbeSettings
from tmax.llm import Teacher, TeacherConfig
from tmax.package_data import CONFIGS
from tmax.tasks.model import (
    DEFINITION_FILES,
    ENV_DIR,
    INSTRUCTION,
    REWARD_FILES,
    SOLUTION_DIR,
    TASK_TOML,
    TEST_SCRIPT,
    TESTS_DIR,
    Task,
)

DEFAULT_CONFIG = CONFIGS / "audit.yaml"

RepairLabel = Literal["verifier_too_weak", "instruction_verifier_mismatch"]
REPAIRABLE: tuple[RepairLabel, ...] = ("verifier_too_weak", "instruction_verifier_mismatch")
"""The labels the teacher repairs (answer_leak is repaired without it)."""

PROMPT_FIELDS: dict[str, tuple[str, ...]] = {
    "auditor_system": ("labels",),
    "auditor_user": ("task_id", "task", "evidence"),
    "repairer_system": ("label", "meaning", "goal", "allowed"),
    "repairer_user": ("task_id", "label", "meaning", "goal", "allowed", "task", "evidence",
                      "feedback"),
    "repair_feedback": ("feedback",),
    "repair_goal": (),
}
"""The ``str.format`` fields each prompt may use (``repair_goals`` values use those of
``repair_goal``: none). Literal braces are written ``{{`` and ``}}``."""

_TEXT_PROBE = 8192
_CUT_RESERVE = 32


class AuditConfigError(ValueError):
    """An audit config that does not load (names the file and each bad field)."""


class RepairRejected(ValueError):
    """A repair that writes where it may not; ``path`` as the teacher gave it."""

    def __init__(self, path: str, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"repair path {path!r}: {reason}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_template(name: str, text: str) -> str:
    allowed = PROMPT_FIELDS[name]
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(text) if f is not None}
    except ValueError as e:
        raise ValueError(f"not a str.format template ({e}); write literal braces as "
                         "{{ and }}") from None
    unknown = sorted(f for f in fields if f not in allowed)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join('{' + f + '}' for f in unknown)}; "
                         f"this prompt may use: {', '.join(allowed) or 'none'} (literal "
                         "braces are written {{ and }})")
    return text


class AuditPrompts(_Strict):
    """The prompts (``prompts:`` in configs/audit.yaml); fields in ``PROMPT_FIELDS``."""

    auditor_system: str
    """``{labels}``: one ``- label: meaning`` line per audit label."""
    auditor_user: str
    """``{task_id}``, ``{task}`` (``task_context``), ``{evidence}`` (the probes', as JSON)."""
    repairer_system: str
    """``{label}``, ``{meaning}``, ``{goal}`` (from ``repair_goals``), ``{allowed}`` (the
    paths the repair may write)."""
    repairer_user: str
    """The system fields plus ``{task_id}``, ``{task}``, ``{evidence}`` and ``{feedback}``
    (``repair_feedback`` formatted, or empty on a first attempt)."""
    repair_feedback: str = ("A previous repair was rejected: {feedback}\nFix that and reply "
                            "with the whole repair again.")
    """``{feedback}``: why the previous attempt was rejected."""
    repair_goals: dict[RepairLabel, str]
    """What a repair of each repairable label must achieve (no fields)."""

    @field_validator("auditor_system", "auditor_user", "repairer_system", "repairer_user",
                     "repair_feedback")
    @classmethod
    def _template(cls, v: str, info: Any) -> str:
        return _check_template(info.field_name, v)

    @field_validator("repair_goals")
    @classmethod
    def _goals(cls, v: dict[RepairLabel, str]) -> dict[RepairLabel, str]:
        missing = [label for label in REPAIRABLE if label not in v]
        if missing:
            raise ValueError(f"missing goal for {', '.join(missing)}")
        for text in v.values():
            _check_template("repair_goal", text)
        return v


class AuditConfig(_Strict):
    """configs/audit.yaml."""

    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    probes: ProbeSettings = Field(default_factory=ProbeSettings)
    max_context_chars: int = Field(default=60_000, ge=1000)
    """How much task text (and, separately, probe evidence) goes to the teacher."""
    prompts: AuditPrompts


def load_audit_config(path: str | Path = DEFAULT_CONFIG) -> AuditConfig:
    """The audit config at ``path``; ``AuditConfigError`` naming the file and each field."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
        return AuditConfig.model_validate(raw or {})
    except (OSError, yaml.YAMLError) as e:
        raise AuditConfigError(f"{path}: {e}") from None
    except ValidationError as e:
        lines = [f"{path}: {e.error_count()} errors"]
        lines += [f"  {'.'.join(str(x) for x in err['loc'])}: {err['msg']}"
                  for err in e.errors()]
        raise AuditConfigError("\n".join(lines)) from None


# ---- the task as text


@dataclass(frozen=True)
class _Entry:
    header: str
    body: str = ""
    unread: int = 0
    """Bytes of the file past what was read (counted as chars cut)."""

    @property
    def size(self) -> int:
        return len(self.body) + self.unread


def _decode(data: bytes, whole: bool) -> str | None:
    """UTF-8 text, or None for a binary; a prefix read (``whole`` false) may end mid-char."""
    if b"\0" in data[:_TEXT_PROBE]:
        return None
    for end in range(len(data), max(-1, len(data) - (1 if whole else 4)), -1):
        try:
            return data[:end].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return None


def _entry(root: Path, path: Path, limit: int) -> _Entry:
    """One file as text (binaries, links, others: a header only); at most ``limit`` bytes
    read."""
    rel = path.relative_to(root).as_posix()
    if path.is_symlink():
        return _Entry(f"=== {rel} (symlink -> {os.readlink(path)}) ===")
    if not path.is_file():  # a FIFO would block the read
        return _Entry(f"=== {rel} (not a regular file) ===")
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            data = f.read(limit)
    except OSError as e:
        return _Entry(f"=== {rel} (unreadable: {e.strerror}) ===")
    text = _decode(data, len(data) >= size)
    if text is None:
        return _Entry(f"=== {rel} (binary, {size} bytes) ===")
    return _Entry(f"=== {rel} ===", text, max(0, size - len(data)))


def _files(root: Path, folder: str, first: tuple[str, ...] = ()) -> list[Path]:
    """Every file under ``root/folder`` (links listed, not followed), ``first`` names first."""
    base = root / folder
    if not base.is_dir() or base.is_symlink():
        return []
    found = []
    for where, dirs, names in os.walk(base):
        dirs.sort()
        found += [Path(where) / n for n in names]
        found += [Path(where) / d for d in dirs if os.path.islink(os.path.join(where, d))]
    order = {name: i for i, name in enumerate(first)}

    def key(p: Path) -> tuple[int, str]:
        rel = p.relative_to(base).as_posix()
        return order.get(rel, len(order)), rel
    return sorted(found, key=key)


def _shares(sizes: list[int], budget: int) -> list[int]:
    """Chars kept of each body: all of the short ones, an equal share of the rest."""
    keep = [0] * len(sizes)
    left, todo = max(0, budget), sorted(range(len(sizes)), key=lambda i: sizes[i])
    for n, i in enumerate(todo):
        keep[i] = min(sizes[i], left // (len(todo) - n))
        left -= keep[i]
    return keep


def clip(text: str, keep: int, unread: int = 0) -> str:
    """``text`` cut to ``keep`` chars around a ``[... N chars cut]`` marker: head and tail,
    or the head only when ``unread`` more chars follow that were never read."""
    cut = len(text) + unread - keep
    if cut <= 0:
        return text
    head = keep if unread else keep * 2 // 3
    tail = text[len(text) - (keep - head):] if keep - head else ""
    return f"{text[:head]}\n[... {cut} chars cut]\n{tail}"


def task_context(task: Task, max_chars: int) -> str:
    """The task as text for the teacher, about ``max_chars`` long at most: instruction.md,
    task.toml, environment/ (its definition first), tests/, solution/, each file headed by
    ``=== relative/path ===``; the budget is shared fairly, so a huge file cannot push the
    verifier or the solution out."""
    root = task.root
    paths = [root / INSTRUCTION, root / TASK_TOML]
    paths += _files(root, ENV_DIR, DEFINITION_FILES)
    paths += _files(root, TESTS_DIR, ("test.sh",)) + _files(root, SOLUTION_DIR, ("solve.sh",))
    entries = [_entry(root, p, 4 * max_chars + 4) for p in paths if os.path.lexists(p)]
    fixed = sum(len(e.header) + _CUT_RESERVE for e in entries)
    keeps = _shares([e.size for e in entries], max_chars - fixed)
    parts = [f"{e.header}\n{clip(e.body, keep, e.unread)}".rstrip("\n")
             for e, keep in zip(entries, keeps)]
    return "\n\n".join(parts) + "\n"


def render_evidence(evidence: dict[str, Any], max_chars: int) -> str:
    """The probes' evidence as indented JSON (keys sorted), cut to ``max_chars``."""
    return clip(json.dumps(evidence, indent=2, sort_keys=True, default=str), max_chars)


# ---- auditor


def _said(rationale: str) -> str:
    if not rationale.strip():
        raise ValueError("the rationale is empty; say why")
    return rationale


class AuditorReply(_Strict):
    """The auditor's answer: one label and why."""

    label: Label
    rationale: str = Field(min_length=1)

    @field_validator("rationale")
    @classmethod
    def _said(cls, v: str) -> str:
        return _said(v)


def label_list() -> str:
    """``- label: meaning`` per audit label (the ``{labels}`` prompt field)."""
    return "\n".join(f"- {describe(label)}" for label in LABELS)


def auditor_messages(config: AuditConfig, task: Task, evidence: dict[str, Any]
                     ) -> list[dict[str, Any]]:
    p = config.prompts
    return [
        {"role": "system", "content": p.auditor_system.format(labels=label_list())},
        {"role": "user", "content": p.auditor_user.format(
            task_id=task.task_id, task=task_context(task, config.max_context_chars),
            evidence=render_evidence(evidence, config.max_context_chars))}]


async def audit_task(teacher: Teacher, config: AuditConfig, task: Task,
                     evidence: dict[str, Any]) -> AuditorReply:
    """The teacher's label for ``task`` given the probes' ``evidence`` (JSON-able)."""
    messages = await asyncio.to_thread(auditor_messages, config, task, evidence)
    reply, _ = await teacher.structured(messages, AuditorReply)
    return reply


# ---- repairer


def allowed_paths(label: str) -> str:
    """The paths a repair of ``label`` may write, in words (the ``{allowed}`` field)."""
    if label == "instruction_verifier_mismatch":
        return f"{TESTS_DIR}/** and {INSTRUCTION}"
    return f"{TESTS_DIR}/**"


def path_problem(rel: str, label: str) -> str | None:
    """Why a repair of ``label`` may not write the task-relative ``rel`` (None: it may)."""
    if not rel or "\0" in rel or "\\" in rel:
        return "not a plain relative path"
    p = PurePosixPath(rel)
    if p.is_absolute():
        return "absolute paths are not allowed"
    if any(part in ("..", ".") for part in rel.split("/")) or "" in rel.split("/"):
        return "'..', '.' and empty parts are not allowed"
    if p.as_posix() == INSTRUCTION:
        if label == "instruction_verifier_mismatch":
            return None
        return f"{INSTRUCTION} may only change for instruction_verifier_mismatch"
    if len(p.parts) >= 2 and p.parts[0] == TESTS_DIR:
        return None
    return f"a repair of {label} may only write {allowed_paths(label)}"


def _overlap_check(files: dict[str, str]) -> None:
    for rel in files:
        inside = [other for other in files if other.startswith(rel.rstrip("/") + "/")]
        if inside:
            raise RepairRejected(inside[0], f"lies inside {rel!r}, which is also a file of "
                                            "the repair")


def _reward_check(files: dict[str, str]) -> None:
    script = files.get(TEST_SCRIPT)
    if script is not None and not any(r in script for r in REWARD_FILES):
        raise RepairRejected(TEST_SCRIPT, f"must write the reward to {REWARD_FILES[0]} "
                                          "(one float in [0, 1])")


class RepairReply(_Strict):
    """The repairer's answer: new full contents by task-relative path, and why."""

    files: dict[str, str] = Field(min_length=1)
    rationale: str = Field(min_length=1)

    @field_validator("rationale")
    @classmethod
    def _said(cls, v: str) -> str:
        return _said(v)


class _Repair(RepairReply):
    """A reply checked against one label's allowed paths, so a bad one goes back to the
    teacher with the reason."""

    label: ClassVar[str] = ""

    @field_validator("files")
    @classmethod
    def _paths(cls, v: dict[str, str]) -> dict[str, str]:
        problems = [f"{rel}: {why}" for rel in v
                    if (why := path_problem(rel, cls.label)) is not None]
        if problems:
            raise ValueError("; ".join(problems))
        _overlap_check(v)
        _reward_check(v)
        return v


class _VerifierRepair(_Repair):
    label = "verifier_too_weak"


class _MismatchRepair(_Repair):
    label = "instruction_verifier_mismatch"


_REPLY_MODELS: dict[str, type[RepairReply]] = {
    "verifier_too_weak": _VerifierRepair, "instruction_verifier_mismatch": _MismatchRepair}


def _repairable(label: str) -> RepairLabel:
    if label not in REPAIRABLE:
        raise ValueError(f"the teacher repairs only {', '.join(REPAIRABLE)}, not {label!r}"
                         " (answer_leak is repaired without it; other labels are dropped)")
    return label  # type: ignore[return-value]


def repairer_messages(config: AuditConfig, task: Task, label: str, evidence: dict[str, Any],
                      feedback: str | None = None) -> list[dict[str, Any]]:
    p = config.prompts
    fields = {"label": label, "meaning": LABELS[label],
              "goal": p.repair_goals[_repairable(label)], "allowed": allowed_paths(label)}
    return [
        {"role": "system", "content": p.repairer_system.format(**fields)},
        {"role": "user", "content": p.repairer_user.format(
            **fields, task_id=task.task_id, task=task_context(task, config.max_context_chars),
            evidence=render_evidence(evidence, config.max_context_chars),
            feedback=p.repair_feedback.format(feedback=feedback) if feedback else "")}]


async def repair_task(teacher: Teacher, config: AuditConfig, task: Task, label: str,
                      evidence: dict[str, Any], feedback: str | None = None) -> RepairReply:
    """The teacher's repair of ``task`` labelled ``label`` (``verifier_too_weak`` or
    ``instruction_verifier_mismatch``; ``ValueError`` for others). ``feedback``: why the
    previous attempt was rejected. The reply names only paths ``apply_repair`` accepts."""
    model = _REPLY_MODELS[_repairable(label)]
    messages = await asyncio.to_thread(repairer_messages, config, task, label, evidence,
                                       feedback)
    reply, _ = await teacher.structured(messages, model)
    return RepairReply(files=reply.files, rationale=reply.rationale)


def _target(task_root: Path, rel: str, label: str) -> Path:
    """Where ``rel`` lands, checked; ``RepairRejected`` when it may not be written."""
    if (why := path_problem(rel, label)) is not None:
        raise RepairRejected(rel, why)
    real_root = os.path.realpath(task_root)
    part = TESTS_DIR if rel.startswith(TESTS_DIR + "/") else ""
    bound = os.path.join(real_root, part) if part else real_root
    target = task_root / rel
    real = os.path.realpath(target)
    if not real.startswith(bound + os.sep):
        raise RepairRejected(rel, f"leads out of {part + '/' if part else 'the task folder'} "
                                  "through a symlink")
    if target.is_dir() and not target.is_symlink():
        raise RepairRejected(rel, "is a folder")
    for parent in target.relative_to(task_root).parents:
        if os.path.lexists(task_root / parent) and not (task_root / parent).is_dir():
            raise RepairRejected(rel, f"{parent.as_posix()} is a file, not a folder")
    return target


def _mode(target: Path, rel: str) -> int:
    if rel == TEST_SCRIPT or rel.endswith(".sh"):
        return 0o755
    if target.is_file() and not target.is_symlink():
        return target.stat().st_mode & 0o777
    return 0o644


def _write_atomic(target: Path, text: str, mode: int) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def apply_repair(task_root: Path, reply: RepairReply, label: str) -> list[str]:
    """Write ``reply``'s files into the task copy at ``task_root``; the paths written.

    Every path is checked before anything is written (``RepairRejected``); ``ValueError``
    for a label the teacher does not repair. Shell scripts get mode 0755, other files keep
    theirs (new ones 0644); a link in the way is replaced, not followed.
    """
    _repairable(label)
    targets = {rel: _target(Path(task_root), rel, label) for rel in reply.files}
    _overlap_check(reply.files)
    _reward_check(reply.files)
    for rel, target in targets.items():
        _write_atomic(target, reply.files[rel], _mode(target, rel))
    return list(targets)


__all__ = ["DEFAULT_CONFIG", "PROMPT_FIELDS", "REPAIRABLE", "AuditConfig", "AuditConfigError",
           "AuditPrompts", "AuditorReply", "RepairLabel", "RepairRejected", "RepairReply",
           "allowed_paths", "apply_repair", "audit_task", "auditor_messages", "clip",
           "label_list", "load_audit_config", "path_problem", "render_evidence", "repair_task",
           "repairer_messages", "task_context"]
