"""Handing a separate verifier the agent's artifacts (Harbor's ``artifacts``).

The copies are made by ``COLLECT_SH`` run as a verifier is run (``verify``: on the local
runtime the agent's processes frozen, the image's own /usr and /bin, a size-limited
/logs/verifier), never by the agent's tools: an agent that replaced ``tar`` or wrote a huge
sparse file gets its artifact dropped, not an infrastructure failure or a full worker disk.
On the host each archive is unpacked as untrusted data: regular files and folders under the
artifact's own path only (no links, devices or fifos; no set-id bits).
"""

from __future__ import annotations

import tarfile
from pathlib import Path, PurePosixPath

COLLECT_SH = """\
#!/bin/sh
# tmax: one tar per artifact into /logs/verifier (what is missing or too big is left out)
i=0
for path in "$@"; do
    if [ -e "$path" ]; then
        tar -C / -cf "/logs/verifier/$i.tar" -- "${path#/}" 2>/dev/null || \\
            rm -f "/logs/verifier/$i.tar"
    fi
    i=$((i + 1))
done
exit 0
"""
TIMEOUT_S = 120.0


def collector(folder: Path) -> Path:
    """``folder`` holding collect.sh (the ``tests`` of the collecting ``verify``)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "collect.sh").write_text(COLLECT_SH)
    return folder


def command(paths: tuple[str, ...]) -> list[str]:
    return ["/bin/sh", "/tests/collect.sh", *paths]


def unpack(collected: Path, paths: tuple[str, ...], dest: Path) -> list[tuple[Path, str]]:
    """The artifacts ``COLLECT_SH`` left in ``collected`` (host copy, path in the sandbox),
    each unpacked into ``dest/<i>``; one whose archive is damaged, or holds nothing of its
    own path, is left out."""
    out = []
    for i, path in enumerate(paths):
        archive = collected / f"{i}.tar"
        if not archive.is_file() or archive.is_symlink():
            continue
        rel = PurePosixPath(path.lstrip("/"))
        target = dest / str(i)
        try:
            with tarfile.open(archive, mode="r:") as tar:
                members = [m for m in tar.getmembers() if _own(m, rel)]
                tar.extractall(target, members=members, filter="data")
        except (tarfile.TarError, OSError, ValueError):
            continue
        if (target / rel).exists() and not (target / rel).is_symlink():
            out.append((target / rel, path))
    return out


def _own(member: tarfile.TarInfo, rel: PurePosixPath) -> bool:
    """A regular file or folder at or under ``rel`` (no link, device, fifo; no ``..``)."""
    name = PurePosixPath(member.name)
    return (member.isfile() or member.isdir()) and ".." not in name.parts and \
        (name == rel or rel in name.parents)
