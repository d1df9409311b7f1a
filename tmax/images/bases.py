"""Which local base stands in for a registry image (FROM lines, ``From:`` headers).

TMax builds task images over local bases (images/<base>.def) instead of pulling registry
images; configs/base-images.yaml maps image references to them.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

import yaml


class BaseMappingError(Exception):
    def __init__(self, image: str, table: Path):
        self.image, self.table = image, table
        super().__init__(f"no local base for image {image!r}: add a mapping to {table}")


def load_base_table(path: Path) -> list[tuple[str, str]]:
    raw = yaml.safe_load(path.read_text()) or {}
    if set(raw) - {"mappings"}:
        raise ValueError(f"{path}: unknown keys {sorted(set(raw) - {'mappings'})}")
    out = []
    for i, m in enumerate(raw.get("mappings", [])):
        if not isinstance(m, dict) or set(m) != {"image", "base"}:
            raise ValueError(f"{path}: mappings[{i}] needs exactly 'image' and 'base'")
        out.append((str(m["image"]), str(m["base"])))
    return out


def map_base(image: str, table: list[tuple[str, str]], table_path: Path) -> str:
    ref = image if ":" in image.rsplit("/", 1)[-1] else f"{image}:latest"
    for pattern, base in table:
        if fnmatch.fnmatchcase(ref, pattern):
            return base
    raise BaseMappingError(image, table_path)


@dataclass(frozen=True)
class BaseTable:
    """The mappings of one table file; ``resolve`` is what task_definition calls."""

    path: Path
    mappings: list[tuple[str, str]]

    @classmethod
    def load(cls, path: Path) -> BaseTable:
        return cls(path, load_base_table(path))

    def resolve(self, image: str) -> str:
        return map_base(image, self.mappings, self.path)
