"""Read, validate and write tasks in the native (Harbor) layout."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import tomli_w

from tmax.tasks.model import (
    ENV_DIR,
    INSTRUCTION,
    TASK_TOML,
    FileSpec,
    Problem,
    Task,
    TaskDraft,
    TaskError,
)
from tmax.tasks.steps import STEPS_DIR
from tmax.tasks.validate import check_task_dir


def load_task(path: str | Path, *, task_id: str | None = None) -> Task:
    """Load a native task, or raise ``TaskError`` listing every error found."""
    root = Path(path)
    task_id = task_id or root.resolve().name
    problems, config = check_task_dir(root, task_id)
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        raise TaskError(errors)
    assert config is not None  # no errors: task.toml parsed
    warnings = tuple(p for p in problems if p.severity == "warning")
    if (root / INSTRUCTION).is_file():
        instruction = (root / INSTRUCTION).read_text()
    else:  # a multi-step task's first step's (the steps hold the instructions)
        first = (config.steps or ({},))[0].get("name", "")
        instruction = (root / STEPS_DIR / first / INSTRUCTION).read_text()
    return Task(task_id, root, instruction, config, warnings)


def validate_task(path: str | Path, *, task_id: str | None = None) -> list[Problem]:
    """Every problem (errors and warnings) of the native task at ``path``."""
    root = Path(path)
    return check_task_dir(root, task_id or root.resolve().name)[0]


def find_tasks(*paths: str | Path) -> list[Path]:
    """Task directories under the given paths (a task dir itself, or a folder of tasks)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"no such task or folder: {p}")
        if is_task_dir(p):
            found.append(p)
        elif p.is_dir():
            found.extend(sorted(c for c in p.iterdir() if c.is_dir() and is_task_dir(c)))
    return found


def is_task_dir(path: Path) -> bool:
    markers = (INSTRUCTION, TASK_TOML, "task.yaml", "task.json")
    return path.is_dir() and any((path / m).is_file() for m in markers)


def read_native(path: Path) -> TaskDraft:
    """A native task as a draft (to copy or rewrite it)."""
    task = load_task(path)
    files = {}
    own = (TASK_TOML,) if task.config.steps else (INSTRUCTION, TASK_TOML)  # (a multi-step
    for f in sorted(path.rglob("*")):  # task's instruction.md, if any, is one of its files)
        rel = f.relative_to(path).as_posix()
        if f.is_file() and rel not in own:
            files[rel] = FileSpec.read(f)
    return TaskDraft(task.task_id, task.instruction, task.config, files, "native",
                     list(task.warnings))


LAYOUTS = ("native", "harbor")


def write_task(draft: TaskDraft, dest_parent: str | Path, *, overwrite: bool = False,
               layout: str = "native") -> Task:
    """Write ``draft`` as ``dest_parent/<task_id>``, atomically.

    ``layout``: ``native`` writes task.toml with every key the draft's config was given, as
    given; ``harbor`` writes what Harbor itself reads (``TaskConfig.to_harbor_dict``: TMax's
    own keys kept under [metadata.tmax], TMax's defaults made explicit). The files are the
    same in both. The task is written to a temporary sibling directory, validated there, then
    renamed into place: an error at any point leaves no half-written task behind (and, with
    ``overwrite``, the previous version untouched).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
    if layout == "harbor" and f"{ENV_DIR}/container.def" in draft.files:
        raise TaskError([Problem(draft.task_id, f"{ENV_DIR}/container.def",
                                 "an Apptainer definition: Harbor builds environment/Dockerfile",
                                 "write the environment as a Dockerfile to export it for "
                                 "Harbor, or keep it native")])
    doc = draft.config.to_harbor_dict() if layout == "harbor" else draft.config.to_toml_dict()
    parent = Path(dest_parent)
    parent.mkdir(parents=True, exist_ok=True)
    final = parent / draft.task_id
    if final.exists() and not overwrite:
        raise TaskError([Problem(draft.task_id, "", f"{final} already exists",
                                 "pass --force to replace it, or choose another folder")])
    tmp = Path(tempfile.mkdtemp(prefix=f".{draft.task_id}.", suffix=".tmp", dir=parent))
    try:
        os.chmod(tmp, 0o755)
        if not draft.config.steps:  # (a multi-step task's are its steps', in its files)
            (tmp / INSTRUCTION).write_text(draft.instruction.rstrip() + "\n")
        (tmp / TASK_TOML).write_text(tomli_w.dumps(doc))
        for rel, spec in draft.files.items():
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(spec.data)
            os.chmod(target, spec.mode)
        task = load_task(tmp, task_id=draft.task_id)
        old = None
        if final.exists():
            old = parent / f".{draft.task_id}.old-{os.getpid()}"
            os.rename(final, old)
        try:
            os.rename(tmp, final)
        except OSError:
            if old is not None:
                os.rename(old, final)  # put the previous version back
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Task(task.task_id, final, task.instruction, task.config, task.warnings)
