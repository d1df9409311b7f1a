"""Read, validate and write tasks in the native layout."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import tempfile
import tomllib
from pathlib import Path

import tomli_w
from pydantic import BaseModel, ValidationError

from tmax.tasks.config import DOMAINS, TaskConfig
from tmax.tasks.confine import Escape, expand_source, link_problems
from tmax.tasks.model import (
    DEFINITION_FILES,
    ENV_DIR,
    INSTRUCTION,
    SOLVE_SCRIPT,
    TASK_ID_RE,
    TASK_TOML,
    TEST_SCRIPT,
    FileSpec,
    Problem,
    Task,
    TaskDraft,
    TaskError,
)


def load_task(path: str | Path, *, task_id: str | None = None) -> Task:
    """Load a native task, or raise ``TaskError`` listing every error found."""
    root = Path(path)
    task_id = task_id or root.resolve().name
    problems, config = _check(root, task_id)
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        raise TaskError(errors)
    instruction = (root / INSTRUCTION).read_text()
    warnings = tuple(p for p in problems if p.severity == "warning")
    return Task(task_id, root, instruction, config, warnings)


def validate_task(path: str | Path, *, task_id: str | None = None) -> list[Problem]:
    """Every problem (errors and warnings) of the native task at ``path``."""
    root = Path(path)
    return _check(root, task_id or root.resolve().name)[0]


def parse_task_toml(text: str, task_id: str, file: str = TASK_TOML) -> TaskConfig:
    """Parse and check task.toml text; raise ``TaskError`` naming each bad field."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise TaskError([Problem(task_id, file, f"not valid TOML: {e}",
                                 "fix the syntax at the position given")]) from None
    try:
        return TaskConfig.model_validate(raw)
    except ValidationError as e:
        raise TaskError([_problem_from_pydantic(task_id, file, err) for err in e.errors()]) from None


def _problem_from_pydantic(task_id: str, file: str, err: dict) -> Problem:
    loc = tuple(str(x) for x in err["loc"])
    dotted = ".".join(loc)
    if err["type"] == "extra_forbidden":
        known = sorted(_model_at(TaskConfig, loc[:-1]).model_fields)
        return Problem(task_id, file, f"unknown key '{loc[-1]}'",
                       f"remove it (known keys here: {', '.join(known)}; "
                       "free-form data goes under [metadata.extra])", dotted)
    if loc and loc[-1] == "domain":
        return Problem(task_id, file, f"invalid domain {err.get('input')!r}",
                       f"use one of: {', '.join(DOMAINS)}", dotted)
    return Problem(task_id, file, f"{err['msg']} (got {err.get('input')!r})",
                   "correct the value", dotted)


def _model_at(model: type[BaseModel], loc: tuple[str, ...]) -> type[BaseModel]:
    for key in loc:
        annotation = model.model_fields[key].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return model
        model = annotation
    return model


def _check(root: Path, task_id: str) -> tuple[list[Problem], TaskConfig | None]:
    def problem(file: str, message: str, fix: str = "", field: str = "",
                severity: str = "error") -> None:
        problems.append(Problem(task_id, file, message, fix, field, severity))

    problems: list[Problem] = []
    if not root.is_dir():
        problem("", f"not a directory: {root}", "point at a task directory")
        return problems, None
    foreign = {"task.yaml": "a Terminal-Bench 1 task", "task.json": "a TMax v1.0 task"}
    if not (root / INSTRUCTION).exists() and not (root / TASK_TOML).exists():
        for marker, what in foreign.items():
            if (root / marker).is_file():
                problem(marker, f"{what}, not the native layout",
                        f"convert it first: tmax tasks convert {root} -d DEST")
                return problems, None
    if not TASK_ID_RE.match(task_id):
        problem("", f"task id {task_id!r} is not lowercase [a-z0-9._-]",
                "rename the directory (e.g. kebab-case)", severity="warning")

    instruction = root / INSTRUCTION
    if not instruction.is_file():
        problem(INSTRUCTION, "missing instruction", "write the task prompt to instruction.md")
    elif not instruction.read_text(errors="replace").strip():
        problem(INSTRUCTION, "instruction is empty", "write the task prompt to instruction.md")

    config = None
    if not (root / TASK_TOML).is_file():
        problem(TASK_TOML, "missing task.toml", "add one (see examples/tasks/*/task.toml)")
    else:
        try:
            config = parse_task_toml((root / TASK_TOML).read_text(), task_id)
        except TaskError as e:
            problems.extend(e.problems)
        else:
            if config.metadata.domain is None:
                problem(TASK_TOML, "no domain", f"set one of: {', '.join(DOMAINS)}",
                        "metadata.domain", "warning")

    problems.extend(link_problems(root, task_id))
    _check_environment(root, task_id, problems)
    _check_verifier(root, task_id, problems)
    if not (root / SOLVE_SCRIPT).is_file():
        problem(SOLVE_SCRIPT, "missing reference solution",
                "add solution/solve.sh: the build-time check runs it and expects reward 1",
                severity="warning")
    return problems, config


def _check_verifier(root: Path, task_id: str, problems: list[Problem]) -> None:
    test_sh = root / TEST_SCRIPT
    if not test_sh.is_file():
        problems.append(Problem(task_id, TEST_SCRIPT, "no verifier",
                                "add tests/test.sh writing /logs/verifier/reward.txt"))
        return
    text = test_sh.read_text(errors="replace")
    if "reward.txt" not in text and "reward.json" not in text:
        problems.append(Problem(
            task_id, TEST_SCRIPT, "the test script writes no reward",
            "write one float in [0,1] to /logs/verifier/reward.txt (or a flat JSON dict "
            "of numbers to /logs/verifier/reward.json), whatever the outcome"))


def _check_environment(root: Path, task_id: str, problems: list[Problem]) -> None:
    env = root / ENV_DIR
    found = [n for n in DEFINITION_FILES if (env / n).is_file()]
    if not found:
        problems.append(Problem(task_id, ENV_DIR, "no environment definition",
                                "add environment/Dockerfile or environment/container.def"))
        return
    if len(found) > 1:
        problems.append(Problem(task_id, ENV_DIR, "both a Dockerfile and a container.def",
                                "keep one of them"))
        return
    if (env / "docker-compose.yaml").exists() or (env / "docker-compose.yml").exists():
        problems.append(Problem(task_id, f"{ENV_DIR}/docker-compose.yaml",
                                "multi-container tasks are not supported; the file is ignored",
                                "fold the services into one image", severity="warning"))
    if found[0] == "Dockerfile":
        problems.extend(_check_dockerfile(env / "Dockerfile", task_id))
    else:
        problems.extend(_check_definition(env / "container.def", task_id))


def dockerfile_instructions(text: str) -> list[tuple[int, str, str]]:
    """(line number, INSTRUCTION, arguments) for each instruction, continuations joined."""
    out: list[tuple[int, str, str]] = []
    buf, start = "", 0
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if not buf:
            start = n
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        word, _, rest = buf.partition(" ")
        out.append((start, word.upper(), rest.strip()))
        buf = ""
    if buf:
        word, _, rest = buf.partition(" ")
        out.append((start, word.upper(), rest.strip()))
    return out


def copy_operands(args: str) -> tuple[list[str], str] | None:
    """(sources, destination) of a COPY/ADD's arguments, shell or JSON form, flags dropped;
    None when it copies from another build stage or image (``--from``)."""
    if args.startswith("["):
        try:
            parts = [str(p) for p in json.loads(args)]
        except (json.JSONDecodeError, TypeError):
            parts = shlex.split(args)
    else:
        parts = shlex.split(args)
    if any(p.startswith("--from=") for p in parts):
        return None
    parts = [p for p in parts if not p.startswith("--")]
    return (parts[:-1], parts[-1]) if parts else ([], "")


def _source_problem(task_id: str, file: str, field: str, word: str, env: Path,
                    src: str) -> Problem | None:
    if "://" in src:
        return Problem(task_id, file, f"{word} fetches {src} at build time",
                       "vendor the file into environment/", field, "warning")
    try:
        found = expand_source(env, src)
    except Escape as e:
        return Problem(task_id, file, f"{word} {e}",
                       f"copy only files under {ENV_DIR}/ (the build context): move the "
                       "file there and name it relative to it", field)
    if not found:
        return Problem(task_id, file, f"{word} source {src!r} not found in environment/",
                       "add the file or fix the path", field)
    return None


def _check_dockerfile(path: Path, task_id: str) -> list[Problem]:
    file = f"{ENV_DIR}/Dockerfile"
    problems: list[Problem] = []
    instructions = dockerfile_instructions(path.read_text(errors="replace"))
    if not instructions or instructions[0][1] not in ("FROM", "ARG"):
        problems.append(Problem(task_id, file, "the Dockerfile has no FROM line first",
                                "start it with FROM <base image>"))
    for line, word, args in instructions:
        operands = copy_operands(args) if word in ("COPY", "ADD") else None
        for src in operands[0] if operands else []:
            if problem := _source_problem(task_id, file, f"line {line}", word, path.parent, src):
                problems.append(problem)
    return problems


def _check_definition(path: Path, task_id: str) -> list[Problem]:
    file = f"{ENV_DIR}/container.def"
    text = path.read_text(errors="replace")
    header = {}
    section = None
    problems: list[Problem] = []
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s.startswith("%"):
            section = s.split()[0][1:].lower()
            continue
        if section is None and ":" in s and not s.startswith("#"):
            key, _, value = s.partition(":")
            header[key.strip().lower()] = value.strip()
        elif section == "files" and s and not s.startswith("#"):
            src = shlex.split(s)[0]
            if problem := _source_problem(task_id, file, f"line {n}", "%files", path.parent,
                                          src):
                problems.append(problem)
    if "bootstrap" not in header:
        problems.append(Problem(task_id, file, "no 'Bootstrap:' header",
                                "start the definition with Bootstrap: and From: lines"))
    return problems


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
    for f in sorted(path.rglob("*")):
        rel = f.relative_to(path).as_posix()
        if f.is_file() and rel not in (INSTRUCTION, TASK_TOML):
            files[rel] = FileSpec.read(f)
    return TaskDraft(task.task_id, task.instruction, task.config, files, "native",
                     list(task.warnings))


def write_task(draft: TaskDraft, dest_parent: str | Path, *, overwrite: bool = False) -> Task:
    """Write ``draft`` as ``dest_parent/<task_id>`` in native layout, atomically.

    The task is written to a temporary sibling directory, validated there, then renamed
    into place: an error at any point leaves no half-written task behind (and, with
    ``overwrite``, the previous version untouched).
    """
    parent = Path(dest_parent)
    parent.mkdir(parents=True, exist_ok=True)
    final = parent / draft.task_id
    if final.exists() and not overwrite:
        raise TaskError([Problem(draft.task_id, "", f"{final} already exists",
                                 "pass --force to replace it, or choose another folder")])
    tmp = Path(tempfile.mkdtemp(prefix=f".{draft.task_id}.", suffix=".tmp", dir=parent))
    try:
        os.chmod(tmp, 0o755)
        (tmp / INSTRUCTION).write_text(draft.instruction.rstrip() + "\n")
        (tmp / TASK_TOML).write_text(tomli_w.dumps(draft.config.to_toml_dict()))
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
