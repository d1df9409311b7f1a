"""Files shipped inside the package, found through ``importlib.resources`` so that an
installed wheel has them as a checkout does: the configs (``tmax/configs``), the local base
definitions (``tmax/images/data``) and the example tasks (``tmax/examples/tasks``). The
checkout's top-level ``configs/``, ``images/`` and ``examples/tasks`` are links to them.
"""

from __future__ import annotations

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


__all__ = ["CONFIGS", "EXAMPLE_TASKS", "IMAGES_DIR", "config_file", "config_names", "shipped"]
