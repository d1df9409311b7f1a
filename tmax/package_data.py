"""Files shipped inside the package, found through ``importlib.resources`` so that an
installed wheel has them as a checkout does: the configs (``tmax/configs``), the local base
definitions (``tmax/images/data``) and the example tasks (``tmax/examples/tasks``). The
checkout's top-level ``configs/``, ``images/`` and ``examples/tasks`` are links to them.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from importlib.resources import files
from pathlib import Path


def shipped(*parts: str) -> Path:
    """The path of a file or folder shipped in the tmax package."""
    ref = files("tmax").joinpath(*parts)
    if not isinstance(ref, Path):
        raise RuntimeError(f"tmax is installed as an archive ({ref}): its data files need an "
                           "unpacked install (pip install, not a zipped package)")
    return ref


CONFIGS = shipped("configs")
IMAGES_DIR = shipped("images", "data")
EXAMPLE_TASKS = shipped("examples", "tasks")
"""As shipped; ``example_tasks()`` is a folder of them to build and run."""


def config_names() -> list[str]:
    """The shipped configs' names (file names without .yaml)."""
    return sorted(p.stem for p in CONFIGS.glob("*.yaml"))


def config_file(name: str | Path) -> Path:
    """A config given as a path (as is, when it is a file) or as a shipped config's name:
    ``qwen3.5-9b``, ``qwen3.5-9b.yaml`` or ``configs/qwen3.5-9b.yaml`` (the checkout's path,
    which then works from any folder and from an installed wheel)."""
    path = Path(name)
    if path.is_file():
        return path
    parts = path.parts[1:] if path.parts[:1] == ("configs",) else path.parts
    if len(parts) == 1:
        for candidate in (CONFIGS / parts[0], CONFIGS / f"{parts[0]}.yaml"):
            if candidate.is_file():
                return candidate
    raise FileNotFoundError(f"no such file, and no shipped config named {path.name!r} "
                            f"(shipped: {', '.join(config_names())}; in {CONFIGS})")


def example_tasks() -> Path:
    """The example tasks to build and run: the shipped folder, or, where pip compiled their
    .py files on install (``__pycache__`` folders in their environment/ and tests/, which
    would go into the images and /tests), a copy without those, made once per content under
    the user's cache (``~/.cache/tmax/example-tasks-<digest>``)."""
    if not any(EXAMPLE_TASKS.rglob("__pycache__")):
        return EXAMPLE_TASKS
    digest = hashlib.sha256()
    for path in sorted(EXAMPLE_TASKS.rglob("*")):
        rel = path.relative_to(EXAMPLE_TASKS)
        if path.is_file() and "__pycache__" not in rel.parts:
            digest.update(f"{rel}\0{os.access(path, os.X_OK)}\0".encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tmax"
    dest = cache / f"example-tasks-{digest.hexdigest()[:16]}"
    if not dest.is_dir():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".example-tasks-", dir=cache))
        try:
            shutil.copytree(EXAMPLE_TASKS, tmp / "tasks", symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
            os.rename(tmp / "tasks", dest)  # another process may have made it first
        except OSError:
            if not dest.is_dir():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def shipped_path(relative: str) -> Path | None:
    """A config's relative path (``examples/tasks``, ``configs/agent-tiny.yaml``) as the
    package ships it, or None; the example tasks as ``example_tasks()`` gives them."""
    parts = Path(relative).parts
    if not parts or Path(relative).is_absolute() or ".." in parts:
        return None
    path = example_tasks().joinpath(*parts[2:]) if parts[:2] == ("examples", "tasks") \
        else shipped(*parts)
    return path if path.exists() else None


__all__ = ["CONFIGS", "EXAMPLE_TASKS", "IMAGES_DIR", "config_file", "config_names",
           "example_tasks", "shipped", "shipped_path"]
