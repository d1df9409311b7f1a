"""Which local base stands in for a registry image (FROM lines, ``From:`` headers).

TMax builds task images over local bases (images/<base>.def) instead of pulling registry
images. configs/base-images.yaml maps image references to them; a user's map file
(``--base-map FILE`` or ``$TMAX_BASE_MAP``, same format) is tried first and may name a base
of its own (a .def file). Image references are normalised before matching: the Docker Hub
prefixes (``docker.io/library/``, ``public.ecr.aws/docker/library/``, ...), any registry's
``<host>/library/`` (a mirror of Docker Hub's official images: ``mirror.example:5000/library/
ruby:3.3-slim``) and a ``@sha256:`` digest are dropped and a missing tag reads as ``latest``, so
``docker.io/library/python:3.12@sha256:...`` matches ``python:3.12*``.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tmax.images.types import parse_definition
from tmax.package_data import CONFIGS, IMAGES_DIR

SHIPPED_TABLE = CONFIGS / "base-images.yaml"
BASE_MAP_ENV = "TMAX_BASE_MAP"

# Registries whose images are Docker Hub's official ones under another name (longest first:
# each is stripped once, then "library/" once more).
HUB_PREFIXES = ("public.ecr.aws/docker/library/", "registry-1.docker.io/", "index.docker.io/",
                "mirror.gcr.io/", "docker.io/")


class BaseMapError(ValueError):
    """A base table or map file that cannot be used (the message names the file and entry)."""


class BaseMappingError(Exception):
    """No base for an image. ``image`` as written, ``table`` the shipped table's path; the
    first line of the message says what to do, the next ones list the known families."""

    def __init__(self, image: str, table: Path, *, known: str = "",
                 user_map: Path | None = None):
        self.image, self.table, self.user_map = image, table, user_map
        ref = normalize(image)
        read_as = f" (read as {ref})" if ref and ref != image.strip() else ""
        mine = f"your map {user_map}" if user_map else \
            f"a file of your own given by --base-map FILE or ${BASE_MAP_ENV}"
        super().__init__(
            f"no local base for image {image!r}{read_as}: map it in {mine} (mappings: "
            f"[{{image: GLOB, base: NAME or FILE.def}}]), or in {table}"
            + (f"; the bases and the images they stand in for:\n{known}" if known else ""))


def _is_registry_host(word: str) -> bool:
    """Whether the first component of a reference is a registry (``host.domain``,
    ``host:port``, ``localhost``), as Docker reads it, not a Docker Hub user."""
    return "." in word or ":" in word or word.lower() == "localhost"


def normalize(image: str) -> str:
    """``name:tag`` of an image reference, as the tables match it (see the module doc);
    "" when there is none."""
    words = [w for w in image.split() if not w.startswith("--")]  # --platform=... if any
    if not words:
        return ""
    ref = words[0].split("@", 1)[0]
    for prefix in HUB_PREFIXES:
        if ref.lower().startswith(prefix):
            ref = ref[len(prefix):]
            break
    else:  # any registry's mirror of Docker Hub's official images: <host>/library/<name>
        host, _, rest = ref.partition("/")
        if _is_registry_host(host) and rest.lower().startswith("library/"):
            ref = rest
    if ref.lower().startswith("library/"):
        ref = ref[len("library/"):]
    name, sep, tag = ref.rpartition(":")
    if not sep or "/" in tag:  # no tag ("host:5000/img" has a port, not a tag)
        name, tag = ref, "latest"
    return f"{name.lower()}:{tag}"


@dataclass(frozen=True)
class Mapping:
    image: str
    """Shell glob on the normalised ``name:tag``."""
    base: str
    """Base name: images/<base>.def, or the stem of a user's .def file."""
    origin: str
    """Where it was written (``FILE mappings[i]``), for messages."""


def _entries(path: Path) -> list[dict]:
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise BaseMapError(f"{path}: cannot read it ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise BaseMapError(f"{path}: not YAML ({e})") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict) or set(raw) - {"mappings"}:
        extra = sorted(set(raw) - {"mappings"}) if isinstance(raw, dict) else type(raw).__name__
        raise BaseMapError(f"{path}: unknown keys {extra}; the file holds only 'mappings: "
                           "[{image: GLOB, base: NAME}]'")
    entries = raw.get("mappings") or []
    if not isinstance(entries, list):
        raise BaseMapError(f"{path}: 'mappings' must be a list of {{image, base}}")
    for i, m in enumerate(entries):
        if not isinstance(m, dict) or set(m) != {"image", "base"} or \
                not all(isinstance(v, str) and v.strip() for v in m.values()):
            raise BaseMapError(f"{path}: mappings[{i}] needs exactly 'image' and 'base' "
                               f"(non-empty strings), got {m!r}")
    return entries


def load_base_table(path: Path, images_dir: Path = IMAGES_DIR) -> list[Mapping]:
    """The shipped table: every base must have images_dir/<base>.def."""
    out = []
    for i, m in enumerate(_entries(path)):
        if not (images_dir / f"{m['base']}.def").is_file():
            raise BaseMapError(f"{path}: mappings[{i}] names base {m['base']!r}, which has no "
                               f"definition {images_dir / (m['base'] + '.def')}")
        out.append(Mapping(m["image"], m["base"], f"{path} mappings[{i}]"))
    return out


def _is_def_path(base: str) -> bool:
    return base.endswith(".def") or "/" in base


def load_user_map(path: Path, images_dir: Path = IMAGES_DIR
                  ) -> tuple[list[Mapping], dict[str, Path]]:
    """A user's map: its mappings, and its own bases (name -> .def, relative to the map)."""
    shipped = sorted(p.stem for p in images_dir.glob("*.def"))
    mappings: list[Mapping] = []
    defs: dict[str, Path] = {}
    for i, m in enumerate(_entries(path)):
        where = f"{path}: mappings[{i}] (image {m['image']!r})"
        base = m["base"]
        if _is_def_path(base):
            file = (path.parent / base).resolve()
            if not file.is_file():
                raise BaseMapError(f"{where}: base file {file} does not exist")
            name = file.stem
            if name in shipped or defs.get(name, file) != file:
                raise BaseMapError(f"{where}: base file {file} has the name {name!r} of "
                                   "another base; rename the file")
            header = parse_definition(file.read_text()).header
            bootstrap = header.get("bootstrap", "").lower()
            if bootstrap not in ("debootstrap", "localimage") or \
                    (bootstrap == "localimage" and not header.get("from")):
                raise BaseMapError(f"{where}: {file} needs 'Bootstrap: debootstrap' or "
                                   "'Bootstrap: localimage' with 'From: <a base name>'")
            defs[name] = file
            base = name
        elif base not in shipped:
            raise BaseMapError(f"{where}: base {base!r} is neither a shipped base "
                               f"({', '.join(shipped)}) nor a .def file")
        mappings.append(Mapping(m["image"], base, where))
    return mappings, defs


def default_base_map(option: str | Path | None = None) -> Path | None:
    """The user map in effect: ``option`` (--base-map), else $TMAX_BASE_MAP, else none."""
    value = option or os.environ.get(BASE_MAP_ENV) or None
    return Path(value) if value else None


@dataclass(frozen=True)
class BaseTable:
    """The user map's mappings (first) and the shipped table's; ``resolve`` is what
    task_definition calls, ``definition_path`` where a base's .def is."""

    path: Path
    mappings: tuple[Mapping, ...]
    images_dir: Path = IMAGES_DIR
    user_map: Path | None = None
    user_defs: dict[str, Path] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path = SHIPPED_TABLE, *, user_map: Path | None = None,
             images_dir: Path = IMAGES_DIR) -> BaseTable:
        user, defs = load_user_map(Path(user_map), images_dir) if user_map else ([], {})
        shipped = load_base_table(Path(path), images_dir)
        return cls(Path(path), tuple(user + shipped), images_dir,
                   Path(user_map) if user_map else None, defs)

    def resolve(self, image: str) -> str:
        ref = normalize(image)
        for m in self.mappings:
            if ref and fnmatch.fnmatchcase(ref, m.image):
                return m.base
        raise BaseMappingError(image, self.path, known=self.known(),
                               user_map=self.user_map)

    def definition_path(self, base: str) -> Path:
        return self.user_defs.get(base) or self.images_dir / f"{base}.def"

    def known(self, per_name: int = 4) -> str:
        """One line per base: its name and the images mapped to it, tags grouped by image
        name (the first few of each)."""
        by_base: dict[str, dict[str, list[str]]] = {}
        for m in self.mappings:
            name, _, tag = m.image.rpartition(":") if ":" in m.image else (m.image, "", "")
            by_base.setdefault(m.base, {}).setdefault(name, []).append(tag)
        lines = []
        for base, names in by_base.items():
            images = [name + (":" + "|".join(tags[:per_name]) + ("|..." if len(tags) > per_name
                                                               else "") if any(tags) else "")
                      for name, tags in names.items()]
            lines.append(f"  {base}: {', '.join(images)}")
        return "\n".join(lines)
