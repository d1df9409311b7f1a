"""Apptainer definition files (a task's ``environment/container.def``, the bases'
``.def`` files): a header and sections, read as Apptainer reads them and written back.
A sibling of ``tmax.tasks.dockerfile``: this package reads what a task declares; the image
build (``tmax.images``) builds it."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field


@dataclass
class Definition:
    """Header (``Bootstrap``, ``From``, ...; keys lower-cased) and sections by name."""

    header: dict[str, str] = field(default_factory=dict)
    sections: dict[str, str] = field(default_factory=dict)

    @property
    def files(self) -> list[tuple[str, str]]:
        """(source, destination) pairs of %files; a missing destination repeats the source."""
        pairs = []
        for line in self.sections.get("files", "").splitlines():
            if line.strip() and not line.strip().startswith("#"):
                src, *dest = shlex.split(line)
                pairs.append((src, dest[0] if dest else src))
        return pairs

    def render(self) -> str:
        head = "\n".join(f"{k.title() if k != 'osversion' else 'OSVersion'}: {v}"
                         for k, v in self.header.items())
        body = "".join(f"\n%{name}\n{text.rstrip()}\n" for name, text in self.sections.items())
        return head + "\n" + body


def parse_definition(text: str) -> Definition:
    d = Definition()
    current = None
    lines: list[str] = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("%") and not s.startswith("%%"):
            if current:
                d.sections[current] = "\n".join(lines)
            current, lines = s.split()[0][1:].lower(), []
        elif current:
            lines.append(line)
        elif s and not s.startswith("#") and ":" in s:
            key, _, value = s.partition(":")
            d.header[key.strip().lower()] = value.strip()
    if current:
        d.sections[current] = "\n".join(lines)
    return d
