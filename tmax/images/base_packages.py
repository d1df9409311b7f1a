"""Whether a base holds what the registry image it stands in for holds (images/packages.yaml).

The file lists, per real image tag, the watched Debian packages the image holds (read from
its published definition), and the known deviations of its stand-in. ``problems`` compares
a base's installed packages (its dpkg status) with one entry; ``check_file`` checks the file
against the base table (each entry's image resolves to the base it names, every shipped
base has an entry) and against the definitions (a package the image lacks, installed by
name in the base's From: chain, is a deviation to list). Run by hand over every base:

    python -m tmax.images.base_packages --all [--store DIR]

(builds the bases the store lacks with the local builder, as root; one line per image).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from sandfleet import layers
from tmax.images.bases import IMAGES_DIR, SHIPPED_TABLE, BaseMappingError, BaseTable
from tmax.images.build import ImageBuilds
from tmax.images.builders import LocalBuilder
from tmax.images.store import ImageStore
from tmax.images.types import parse_definition

PACKAGES_FILE = IMAGES_DIR / "packages.yaml"
ENTRY_KEYS = {"image", "base", "source", "has", "unknown", "deviations"}
DEVIATION_KEYS = {"extra", "missing", "why"}
# a compiler needs these to compile anything: never a tolerated deviation
TOOLCHAIN_NEEDS = {"gcc": "libc6-dev", "g++": "libc6-dev"}


class PackagesFileError(ValueError):
    """images/packages.yaml (or another such file) that cannot be used; names file and entry."""


@dataclass(frozen=True)
class Expectation:
    image: str
    base: str
    source: str
    has: frozenset[str]
    lacks: frozenset[str]
    extra: frozenset[str]
    """Known: held by the stand-in, not by the image."""
    missing: frozenset[str]
    """Known: held by the image, not by the stand-in."""
    why: str


def _names(value, where: str, field: str, watched: set[str] | None) -> frozenset[str]:
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise PackagesFileError(f"{where}: '{field}' must be a list of package names")
    unknown = set(value) - watched if watched is not None else set()
    if unknown:
        raise PackagesFileError(f"{where}: '{field}' names {sorted(unknown)}, which are not "
                                "in 'watched'; add them there or drop them")
    return frozenset(value)


def load_expectations(path: Path = PACKAGES_FILE) -> list[Expectation]:
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise PackagesFileError(f"{path}: cannot read it ({err})") from None
    if not isinstance(raw, dict) or set(raw) != {"watched", "images"}:
        raise PackagesFileError(f"{path}: needs exactly 'watched' and 'images'")
    watched = set(_names(raw["watched"], str(path), "watched", None))
    out = []
    for i, e in enumerate(raw["images"] or []):
        where = f"{path}: images[{i}]"
        if not isinstance(e, dict) or not {"image", "base", "source", "has"} <= set(e) or \
                set(e) - ENTRY_KEYS:
            raise PackagesFileError(f"{where}: needs image, base, source, has (and may have "
                                    f"unknown, deviations); got {sorted(e) if isinstance(e, dict) else e!r}")
        where = f"{where} ({e['image']})"
        dev = e.get("deviations") or {}
        if not isinstance(dev, dict) or set(dev) - DEVIATION_KEYS or \
                (dev and not dev.get("why")):
            raise PackagesFileError(f"{where}: 'deviations' holds extra, missing and why "
                                    "(why is required)")
        has = _names(e["has"], where, "has", watched)
        unknown = _names(e.get("unknown"), where, "unknown", watched)
        extra = _names(dev.get("extra"), where, "deviations.extra", watched)
        missing = _names(dev.get("missing"), where, "deviations.missing", watched)
        lacks = frozenset(watched - has - unknown)
        wrong = sorted((has & unknown) | (extra - lacks) | (missing - has))
        if wrong:
            raise PackagesFileError(f"{where}: {wrong}: a package is either held ('has') or "
                                    "unknown; an 'extra' one is one the image lacks, a "
                                    "'missing' one one it holds")
        out.append(Expectation(e["image"], e["base"], str(e["source"]), has, lacks, extra,
                               missing, str(dev.get("why", ""))))
    return out


def problems(expected: Expectation, installed: set[str]) -> list[str]:
    """What is wrong with a base whose installed packages are ``installed``, for
    ``expected.image``: unlisted extra or missing packages, listed deviations that no longer
    hold, a compiler without what it needs. Empty when the base is as the file says."""
    out = []
    extra = expected.lacks & installed
    missing = expected.has - installed
    if extra - expected.extra:
        out.append(f"holds {sorted(extra - expected.extra)}, which {expected.image} lacks")
    if missing - expected.missing:
        out.append(f"lacks {sorted(missing - expected.missing)}, which {expected.image} holds")
    stale = (expected.extra - extra) | (expected.missing - missing)
    if stale:
        out.append(f"the deviations {sorted(stale)} listed for it no longer hold: "
                   f"remove them from {PACKAGES_FILE.name}")
    for tool, need in TOOLCHAIN_NEEDS.items():
        if tool in installed and need not in installed:
            out.append(f"holds {tool} without {need}: `apt-get install {tool}` is then a "
                       f"no-op and compiling fails (stdio.h: No such file or directory)")
    return out


def dpkg_installed(status_text: str) -> set[str]:
    """Names of the installed packages in a dpkg status file."""
    out = set()
    for stanza in status_text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in stanza.splitlines()
                      if ": " in line and not line.startswith(" "))
        if fields.get("Status", "").endswith(" installed") and "Package" in fields:
            out.add(fields["Package"])
    return out


def sif_installed(sif_path: Path) -> set[str]:
    """The installed packages of an image's root (a SIF or a layered image: its
    /var/lib/dpkg/status, read with unsquashfs -cat, no extraction)."""
    text = layers.cat(sif_path, "var/lib/dpkg/status")
    if not text:
        raise RuntimeError(f"{sif_path}: cannot read var/lib/dpkg/status")
    return dpkg_installed(text)


_STEP = re.compile(r"(?:apt-get (install|purge|remove)|apt-mark (auto|manual)) ([^\n]*)"
                   r"|^include:([^\n]*)", re.IGNORECASE | re.MULTILINE)


def _words(text: str) -> set[str]:
    return {w.split("=")[0] for w in text.split() if not w.startswith("-") and re.fullmatch(
        r"[a-z0-9][a-z0-9+.\-]*(=\S+)?", w)}


def _code(definition: str) -> str:
    """The definition without comment lines, continued lines joined."""
    return "\n".join(line for line in definition.splitlines()
                     if not line.lstrip().startswith("#")).replace("\\\n", " ")


def named_packages(definition: str, before: frozenset[str] | set[str] = frozenset()
                   ) -> set[str]:
    """The packages held by name after a definition runs over a base holding ``before``:
    its Include: and apt-get install add, apt-get purge/remove take away, in order (comments
    skipped). The official images' idiom for build tools, ``apt-mark auto '.*'``, then
    ``apt-mark manual`` of what stays, then ``apt-get purge --auto-remove``, keeps of what
    was held only what it marks manual by name (libraries it keeps through ldd are not
    named)."""
    held = set(before)
    pool: set[str] = set()
    for m in _STEP.finditer(_code(definition)):
        apt_get, apt_mark, args, include = m.groups()
        words = _words(include if include is not None else args)
        if apt_mark and apt_mark.lower() == "auto" and ".*" in args:
            pool, held = held, set()
        elif apt_mark and apt_mark.lower() == "manual":
            held |= words & pool
        elif apt_mark:
            continue
        elif include is not None or apt_get.lower() == "install":
            held |= words
        else:
            held -= words
    return held


def check_file(expectations: list[Expectation], table: BaseTable) -> list[str]:
    """The file against the table and the definitions (no build)."""
    out = []
    for e in expectations:
        try:
            resolved = table.resolve(e.image)
        except BaseMappingError as err:
            out.append(f"{e.image}: no base in the table ({str(err).splitlines()[0]})")
            continue
        if resolved != e.base:
            out.append(f"{e.image}: the table gives {resolved}, {PACKAGES_FILE.name} says "
                       f"{e.base}")
            continue
        chain = _chain(table, e.base)
        named: set[str] = set()
        for name in chain:  # parent first: a child's purge undoes its parent's install
            named = named_packages(table.definition_path(name).read_text(), named)
        unlisted = (e.lacks & named) - e.extra
        if unlisted:
            out.append(f"{e.image}: {' -> '.join(chain)} installs {sorted(unlisted)}, which "
                       f"the image lacks; remove them or list them as deviations")
    covered = {e.base for e in expectations}
    for base in sorted({m.base for m in table.mappings} - covered):
        out.append(f"base {base}: no image in {PACKAGES_FILE.name} says what it must hold")
    return out


def _chain(table: BaseTable, base: str) -> list[str]:
    chain = [base]
    while len(chain) < 8:
        header = parse_definition(table.definition_path(chain[-1]).read_text()).header
        if header.get("bootstrap", "").lower() != "localimage":
            break
        chain.append(header["from"])
    return chain[::-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", type=Path,
                        default=Path.home() / ".cache" / "tmax" / "test-store")
    parser.add_argument("--all", action="store_true",
                        help="build the bases the store lacks (local builder, as root)")
    parser.add_argument("bases", nargs="*", help="only these bases")
    args = parser.parse_args(argv)
    expectations = load_expectations()
    table = BaseTable.load(SHIPPED_TABLE)
    failures = check_file(expectations, table)
    for line in failures:
        print(f"FILE {line}")
    store = ImageStore(args.store)
    builds = ImageBuilds(store, LocalBuilder(Path.home() / ".cache" / "tmax"))
    seen: dict[str, set[str] | str] = {}
    for e in expectations:
        if args.bases and e.base not in args.bases:
            continue
        if e.base not in seen:
            try:
                entry = store.read().bases.get(e.base)
                if not (entry and entry.digest == builds.base_digest(e.base)
                        and store.path(entry.sif).exists()):
                    entry = builds.ensure_base(e.base) if args.all else None
                seen[e.base] = sif_installed(store.path(entry.sif)) if entry else \
                    f"not built in {args.store} (--all builds it)"
            except Exception as err:  # noqa: BLE001 - reported per base
                seen[e.base] = f"cannot build or read it: {str(err)[-300:]}"
        got = seen[e.base]
        found = [got] if isinstance(got, str) else problems(e, got)
        failures += found
        print(f"{'FAIL' if found else 'ok  '} {e.image} -> {e.base}"
              + "".join(f"\n       {p}" for p in found)
              + (f"\n       known: extra {sorted(e.extra)} missing {sorted(e.missing)}"
                 if not found and (e.extra or e.missing) else ""), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
