"""Readers for foreign task layouts, each producing a native ``TaskDraft``.

- Terminal-Bench 1: ``task.yaml``, ``Dockerfile`` (+ the files it copies), ``run-tests.sh``,
  ``tests/``, ``solution.sh`` or ``solution.yaml``. Its verdict is all-or-nothing: the
  converted ``tests/test.sh`` runs ``run-tests.sh`` (or the test file with pytest) and writes
  reward 1 iff it passes.
- TMax v1.0: ``task.json``, ``container.def``, ``setup.sh``, ``test_initial_state.py``,
  ``test_final_state.py`` (optionally ``solution.sh``). ``setup.sh`` is folded into the
  definition (copied by ``%files``, run at the end of ``%post``); the converted verifier runs
  the final-state tests (reward 1 iff all pass); the initial-state tests are kept in
  ``tests/`` for audits.
"""

from __future__ import annotations

import json
import os
import re
from importlib import resources
from pathlib import Path

import yaml

from tmax.tasks.config import TaskConfig
from tmax.tasks.config_tables import DOMAINS, Metadata
from tmax.tasks.dockerfile import DockerfileError
from tmax.tasks.dockerfile import parse as parse_dockerfile
from tmax.tasks.model import FileSpec, Problem, TaskDraft, TaskError
from tmax.tasks.native import is_task_dir, read_native
from tmax.tasks.validate import validate_config

PYTEST_LITE = "tests/tmax_pytest_lite.py"

_VERDICT = """\
status=$?
if [ "$status" -eq 0 ]; then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; fi
exit 0
"""


def detect_format(path: Path) -> str:
    """'native', 'tb1' or 'tmax-v1', from the marker files in ``path``."""
    if (path / "task.toml").is_file() or (path / "instruction.md").is_file():
        return "native"
    if (path / "task.yaml").is_file():
        return "tb1"
    if (path / "task.json").is_file():
        return "tmax-v1"
    raise TaskError([Problem(path.name, "", "not a task: no task.toml, task.yaml or task.json",
                             "point at a task directory")])


def read_any(path: str | Path) -> TaskDraft:
    """Read a task in any supported layout as a native draft."""
    path = Path(path)
    if not is_task_dir(path):
        detect_format(path)  # raises with a clear message
    fmt = detect_format(path)
    return {"native": read_native, "tb1": read_tb1, "tmax-v1": read_tmax_v1}[fmt](path)


def _pytest_lite() -> FileSpec:
    return FileSpec((resources.files("tmax.tasks") / "pytest_lite.py").read_bytes(), 0o755)


def _domain_for(category: str) -> str | None:
    guess = category.strip().lower().replace("_", "-").replace(" ", "-")
    return guess if guess in DOMAINS else None


def _config(task_id: str, file: str, raw: dict) -> TaskConfig:
    return validate_config(raw, task_id, file)


def _collect(root: Path, skip: set[str]) -> dict[str, FileSpec]:
    """Files under ``root`` (relative paths) except the top-level names in ``skip``."""
    out = {}
    for f in sorted(root.rglob("*")):
        rel = f.relative_to(root)
        if f.is_file() and rel.parts[0] not in skip:
            out[rel.as_posix()] = FileSpec.read(f)
    return out


# --------------------------------------------------------------------------- Terminal-Bench 1

TB1_MAPPED = {
    "instruction", "descriptions", "author_name", "author_email", "difficulty", "category",
    "tags", "max_agent_timeout_sec", "max_test_timeout_sec",
}
"""task.yaml keys the converter reads; every other key is kept in [metadata] as written."""

TB1_SPECIAL = {"task.yaml", "run-tests.sh", "solution.sh", "solution.yaml", "tests",
               "docker-compose.yaml", "docker-compose.yml"}


def _tb1_context_reaches(path: Path) -> set[str]:
    """The converter's own names (tests/, run-tests.sh, ...) that the Dockerfile's COPY/ADD
    sources reach: TB1 builds with the whole task folder as its context, so those stay in
    environment/ too (the tests still reach the verifier through tests/)."""
    try:
        sources = [src for _, _, src in
                   parse_dockerfile((path / "Dockerfile").read_text(errors="replace"))
                   .copy_sources()]
    except (DockerfileError, OSError):
        return set()  # reported by validation
    reached: set[str] = set()
    for src in sources:
        first = os.path.normpath(src.lstrip("/")).split("/")[0]
        if first in (".", "") or any(c in first for c in "*?["):
            reached |= TB1_SPECIAL  # the whole folder, or a glob over its top level
        elif first in TB1_SPECIAL:
            reached.add(first)
    return reached & {p.name for p in path.iterdir()}


def _tb1_kept_keys(meta: dict) -> tuple[dict, list[str]]:
    """task.yaml keys the converter does not map, for [metadata]: as written, except that a
    name TMax types in [metadata] (``domain``, ``skills``...) gets a ``tb1_`` prefix, and a
    key without a value (TOML has no null) is left out. Returns (kept, left out)."""
    kept, dropped = {}, []
    for key, value in meta.items():
        if key == "descriptions" and isinstance(value, list) and len(value) > 1:
            pass  # the variants beside the one used as the instruction
        elif key in TB1_MAPPED:
            continue
        if _has_null(value):
            dropped.append(key)
            continue
        kept[f"tb1_{key}" if key in Metadata.model_fields else str(key)] = value
    return kept, dropped


def _has_null(value) -> bool:
    if value is None:
        return True
    if isinstance(value, dict):
        return any(_has_null(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_null(v) for v in value)
    return False


def read_tb1(path: Path) -> TaskDraft:
    task_id = path.resolve().name
    file = "task.yaml"

    def fail(message: str, fix: str, field: str = "", where: str = file) -> TaskError:
        return TaskError([Problem(task_id, where, message, fix, field)])

    try:
        meta = yaml.safe_load((path / file).read_text()) or {}
    except yaml.YAMLError as e:
        raise fail(f"not valid YAML: {e}", "fix the syntax") from None
    if not isinstance(meta, dict):
        raise fail("expected a mapping at the top level", "see Terminal-Bench's task.yaml")
    instruction = meta.get("instruction")
    if not instruction and isinstance(meta.get("descriptions"), list):
        base = [d for d in meta["descriptions"] if isinstance(d, dict) and d.get("key") == "base"]
        instruction = (base or meta["descriptions"])[0].get("description")
    if not instruction or not str(instruction).strip():
        raise fail("missing instruction", "add an 'instruction:' text", "instruction")
    if not (path / "Dockerfile").is_file():
        raise fail("no Dockerfile", "add the task's Dockerfile", where="Dockerfile")
    warnings: list[Problem] = []
    for compose in ("docker-compose.yaml", "docker-compose.yml"):
        if (path / compose).is_file():
            services = (yaml.safe_load((path / compose).read_text()) or {}).get("services", {})
            if len(services) > 1:
                raise fail(f"{len(services)} services: multi-container tasks are not supported",
                           "fold the services into one image", "services", compose)

    files = {f"environment/{k}": v
             for k, v in _collect(path, TB1_SPECIAL - _tb1_context_reaches(path)).items()}
    if (path / "tests").is_dir():
        files.update({f"tests/{k}": v for k, v in _collect(path / "tests", set()).items()})
    if "tests/test.sh" in files:
        raise fail("tests/test.sh exists and would be overwritten by the converted verifier",
                   "rename it", where="tests/test.sh")
    if (path / "run-tests.sh").is_file():
        files["tests/run-tests.sh"] = FileSpec.read(path / "run-tests.sh")
        run = "bash /tests/run-tests.sh"
        if re.search(r"\b(curl|wget|pip install|uv (pip|venv|add|sync)|apt-get)\b",
                     (path / "run-tests.sh").read_text(errors="replace")):
            warnings.append(Problem(task_id, "run-tests.sh", "installs packages at test time",
                                    "bake them into the image or set environment.network",
                                    severity="warning"))
    else:
        files[PYTEST_LITE] = _pytest_lite()
        run = "python3 /tests/tmax_pytest_lite.py /tests/test_outputs.py"
    files["tests/test.sh"] = FileSpec.script(
        "#!/bin/bash\n# Converted from Terminal-Bench 1 by tmax: reward 1 iff the tests pass.\n"
        "mkdir -p /logs/verifier\nexport TEST_DIR=/tests\n"
        f"{run}\n{_VERDICT}")
    if (path / "solution.sh").is_file():
        files["solution/solve.sh"] = FileSpec(FileSpec.read(path / "solution.sh").data, 0o755)
    elif (path / "solution.yaml").is_file():
        steps = yaml.safe_load((path / "solution.yaml").read_text()) or []
        commands = [s["command"] if isinstance(s, dict) else str(s) for s in steps]
        files["solution/solve.sh"] = FileSpec.script(
            "#!/bin/bash\n# Converted from Terminal-Bench 1 solution.yaml\n"
            + "\n".join(commands) + "\n")

    category = str(meta.get("category", ""))
    difficulty = meta.get("difficulty", "medium")
    kept, dropped = _tb1_kept_keys(meta)
    if difficulty not in ("easy", "medium", "hard"):
        warnings.append(Problem(task_id, file, f"difficulty {difficulty!r} read as medium "
                                "(kept as metadata.tb1_difficulty)",
                                "set easy, medium or hard", "difficulty", "warning"))
        if difficulty is not None:
            kept["tb1_difficulty"] = difficulty
        difficulty = "medium"
    for key in dropped:
        warnings.append(Problem(task_id, file, f"{key!r} has no value; not kept", "",
                                key, "warning"))
    raw = {
        "metadata": {
            **kept,
            "author_name": str(meta.get("author_name", "")),
            "author_email": str(meta.get("author_email", "")),
            "difficulty": difficulty, "category": category, "domain": _domain_for(category),
            "tags": [str(t) for t in meta.get("tags") or []],
            "source": "converted from terminal-bench-1",
        },
    }
    if "max_agent_timeout_sec" in meta:
        raw["agent"] = {"timeout_sec": meta["max_agent_timeout_sec"]}
    if "max_test_timeout_sec" in meta:
        raw["verifier"] = {"timeout_sec": meta["max_test_timeout_sec"]}
    config = _config(task_id, file, raw)
    return TaskDraft(task_id, str(instruction), config, files, "tb1", warnings)


# --------------------------------------------------------------------------- TMax v1.0

V1_KEYS = {
    "id", "name", "description", "instruction", "truth", "difficulty", "category", "domain",
    "tags", "skills", "axes", "timeout_sec", "verifier_timeout_sec", "cpus", "memory_mb",
    "network",
}
V1_SPECIAL = {"task.json", "container.def", "setup.sh", "test_initial_state.py",
              "test_final_state.py", "solution.sh"}


def read_tmax_v1(path: Path) -> TaskDraft:
    task_id = path.resolve().name
    file = "task.json"

    def fail(message: str, fix: str, field: str = "", where: str = file) -> TaskError:
        return TaskError([Problem(task_id, where, message, fix, field)])

    try:
        meta = json.loads((path / file).read_text())
    except json.JSONDecodeError as e:
        raise fail(f"not valid JSON: {e}", "fix the syntax") from None
    if not isinstance(meta, dict):
        raise fail("expected a JSON object", "see the TMax v1.0 task.json format")
    unknown = sorted(set(meta) - V1_KEYS)
    if unknown:
        raise fail(f"unknown key(s) {', '.join(unknown)}",
                   f"remove them (known: {', '.join(sorted(V1_KEYS))})", unknown[0])
    instruction = meta.get("instruction") or meta.get("description")
    if not instruction or not str(instruction).strip():
        raise fail("missing instruction", "add a 'description' text", "description")
    for required in ("container.def", "test_final_state.py"):
        if not (path / required).is_file():
            raise fail(f"missing {required}", f"add {required}", where=required)

    definition = (path / "container.def").read_text()
    if (path / "setup.sh").is_file():
        definition = fold_setup_script(definition, "setup.sh")
    files = {f"environment/{k}": v for k, v in _collect(path, V1_SPECIAL).items()}
    files["environment/container.def"] = FileSpec(definition.encode())
    if (path / "setup.sh").is_file():
        files["environment/setup.sh"] = FileSpec(FileSpec.read(path / "setup.sh").data, 0o755)
    for test in ("test_initial_state.py", "test_final_state.py"):
        if (path / test).is_file():
            files[f"tests/{test}"] = FileSpec.read(path / test)
    if "truth" in meta:
        truth = meta["truth"]
        files["tests/truth.txt"] = FileSpec(
            (truth if isinstance(truth, str) else json.dumps(truth)).encode())
    files[PYTEST_LITE] = _pytest_lite()
    files["tests/test.sh"] = FileSpec.script(
        "#!/bin/bash\n# Converted from TMax v1.0 by tmax: reward 1 iff the final-state tests "
        "pass.\nmkdir -p /logs/verifier\n"
        "python3 /tests/tmax_pytest_lite.py /tests/test_final_state.py\n" + _VERDICT)
    if (path / "solution.sh").is_file():
        files["solution/solve.sh"] = FileSpec(FileSpec.read(path / "solution.sh").data, 0o755)

    category = str(meta.get("category", ""))
    raw: dict = {
        "metadata": {
            "difficulty": meta.get("difficulty", "medium"), "category": category,
            "domain": meta.get("domain") or _domain_for(category),
            "tags": meta.get("tags", []), "skills": meta.get("skills", []),
            "axes": meta.get("axes", {}), "source": "converted from tmax-v1.0",
        },
        "environment": {k: meta[k] for k in ("cpus", "memory_mb", "network") if k in meta},
    }
    if "timeout_sec" in meta:
        raw["agent"] = {"timeout_sec": meta["timeout_sec"]}
    if "verifier_timeout_sec" in meta:
        raw["verifier"] = {"timeout_sec": meta["verifier_timeout_sec"]}
    config = _config(task_id, file, raw)
    return TaskDraft(str(meta.get("id") or task_id), str(instruction), config, files, "tmax-v1")


def fold_setup_script(definition: str, script: str, dest: str = "/opt/tmax/setup.sh") -> str:
    """Add ``script`` to an Apptainer definition: copied in by %files, run last in %post."""
    lines = definition.rstrip("\n").splitlines()
    sections = [i for i, line in enumerate(lines) if line.strip().startswith("%")]

    def find(name: str) -> int | None:
        return next((i for i in sections if lines[i].strip().split()[0] == name), None)

    def end_of(start: int) -> int:
        later = [i for i in sections if i > start]
        return later[0] if later else len(lines)

    files_at = find("%files")
    if files_at is None:
        lines += ["", "%files", f"    {script} {dest}"]
    else:
        lines.insert(end_of(files_at), f"    {script} {dest}")
        sections = [i for i, line in enumerate(lines) if line.strip().startswith("%")]
    post_at = find("%post")
    run = f"    bash {dest} && rm -f {dest}"
    if post_at is None:
        lines += ["", "%post", run]
    else:
        lines.insert(end_of(post_at), run)
    return "\n".join(lines) + "\n"
