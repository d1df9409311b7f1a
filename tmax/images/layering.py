"""A built task image split into layers over its base (``sandfleet.runtime.layers``).

The builders make a whole root, as before; ``split`` compares it with its base's root and
packs only what differs as read-only squashfs layers: the verifier tools (``/.tmax``, the
same for every task with the same tools: stored once) and the task's own changes
(everything else: added and changed entries, and a whiteout, a character device 0/0, for
each entry of the base the task removed, as overlayfs reads lower layers). A layer file
is named by the sha256 of its bytes, so equal layers are one file in the store.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock

from sandfleet import sif
from tmax.images.types import DEFAULT_PATH, BuildError

TOOLS_TOP = ".tmax"
"""The top-level folder of the verifier tools (``tmax.images.verifier_tools.ROOT``'s)."""
TOOLS_UNMET = ".tmax/verifier/unmet"
"""What this task's build could not prepare (``tmax.images.verifier_tools``): in its own
layer, never in a tools layer other tasks share."""
TOOLS_FORMAT = "tools-layer 3"
"""In the key of a shared tools layer (``layers/tools-<key>.sqfs``): a new way of making
them is a new key."""


@dataclass
class Diff:
    """What an image root has that its base's has not: paths relative to the roots."""

    entries: list[str] = field(default_factory=list)
    """Added or changed entries, parents before children (a folder listed alone when only
    its attributes changed, or as the parent of what changed below it)."""
    whiteouts: list[str] = field(default_factory=list)
    """Entries of the base the image has not."""


Owners = dict[str, tuple[int, int, int]]
"""Path (relative, "" the root) -> (mode with its type bits, uid, gid), as a squashfs
records them: what a build as an ordinary user cannot read from the unpacked files."""
_LINE = re.compile(r"^(\S{10}) (\d+)/(\d+) +(?:\d+|\d+, +\d+) \d{4}-\d\d-\d\d \d\d:\d\d ?(.*)$")
_TYPES = {"d": stat.S_IFDIR, "-": stat.S_IFREG, "l": stat.S_IFLNK, "c": stat.S_IFCHR,
          "b": stat.S_IFBLK, "p": stat.S_IFIFO, "s": stat.S_IFSOCK}


def _mode(text: str) -> int:
    """``drwsr-xr-t`` as a mode."""
    mode = _TYPES[text[0]]
    for i, (bit, special) in enumerate(((stat.S_IRUSR, 0), (stat.S_IWUSR, 0),
                                         (stat.S_IXUSR, stat.S_ISUID), (stat.S_IRGRP, 0),
                                         (stat.S_IWGRP, 0), (stat.S_IXGRP, stat.S_ISGID),
                                         (stat.S_IROTH, 0), (stat.S_IWOTH, 0),
                                         (stat.S_IXOTH, stat.S_ISVTX))):
        c = text[1 + i]
        if c in "rwxst":
            mode |= bit
        if c in "sStT" and special:
            mode |= special
    return mode


def owners(path: Path, offset: int = 0, timeout: float = 600) -> Owners:
    """The owners and modes of every entry of a squashfs (at ``offset`` of ``path``)."""
    out = subprocess.run(["unsquashfs", "-o", str(offset), "-lln", "-n", "-d", "", str(path)],
                         capture_output=True, text=True, timeout=timeout,
                         stdin=subprocess.DEVNULL, check=False)
    if out.returncode != 0:
        raise BuildError("layers", f"unsquashfs -lln {path}: {out.stderr.strip()[-500:]}")
    found: Owners = {}
    for line in out.stdout.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        name = m.group(4)
        if m.group(1)[0] == "l":
            name = name.split(" -> ", 1)[0]
        found[name.lstrip("/")] = (_mode(m.group(1)), int(m.group(2)), int(m.group(3)))
    return found


def _escaped(rel: str) -> str:
    """A path as mksquashfs's pseudo definitions read it."""
    if "\n" in rel:
        raise BuildError("layers", f"cannot name {rel!r} (a name with a newline) in a layer")
    return "".join("\\" + c if c.isspace() or c in '"\\' else c for c in rel)


def _xattrs(path: Path) -> dict[str, bytes]:
    try:
        return {k: os.getxattr(path, k, follow_symlinks=False)
                for k in sorted(os.listxattr(path, follow_symlinks=False))}
    except OSError:
        return {}


def _same_content(a: Path, b: Path) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(1 << 20), fb.read(1 << 20)
            if x != y:
                return False
            if not x:
                return True


def _same(image: Path, base: Path, si: os.stat_result, sb: os.stat_result,
          owned: tuple[tuple, tuple] | None = None) -> bool:
    """Whether an entry of the image equals the base's at the same path (not looking below
    folders); ``owned``: their (mode, uid, gid) as recorded, in place of the files'."""
    mi, mb = owned or ((si.st_mode, si.st_uid, si.st_gid), (sb.st_mode, sb.st_uid, sb.st_gid))
    if stat.S_IFMT(si.st_mode) != stat.S_IFMT(sb.st_mode) or mi != mb or \
            _xattrs(image) != _xattrs(base):
        return False
    if stat.S_ISDIR(si.st_mode):
        return True
    if stat.S_ISLNK(si.st_mode):
        return os.readlink(image) == os.readlink(base)
    if stat.S_ISCHR(si.st_mode) or stat.S_ISBLK(si.st_mode):
        return si.st_rdev == sb.st_rdev
    if stat.S_ISREG(si.st_mode):
        return si.st_size == sb.st_size and int(si.st_mtime) == int(sb.st_mtime) and \
            _same_content(image, base)
    return True  # fifos, sockets: their attributes above


def diff(image: Path, base: Path, owned: tuple[Owners, Owners] | None = None) -> Diff:
    """``image``'s root against ``base``'s (both unpacked, links never followed); with
    ``owned``, their owners and modes as recorded (``owners``), not the files'."""
    out = Diff()

    def same(pi: Path, pb: Path, si: os.stat_result, sb: os.stat_result, rel: str) -> bool:
        if owned is None:
            return _same(pi, pb, si, sb)
        missing = (-1, -1, -1)
        return _same(pi, pb, si, sb, (owned[0].get(rel, missing), owned[1].get(rel, missing)))

    def walk(rel: str) -> bool:
        """Compare folder ``rel`` (present in both as folders); True if anything below
        it differs (its own entry then listed by the caller)."""
        here_i, here_b = image / rel if rel else image, base / rel if rel else base
        names_i, names_b = set(os.listdir(here_i)), set(os.listdir(here_b))
        changed = False
        for name in sorted(names_b - names_i):
            out.whiteouts.append(f"{rel}/{name}" if rel else name)
            changed = True
        for name in sorted(names_i):
            sub = f"{rel}/{name}" if rel else name
            pi = here_i / name
            si = pi.lstat()
            if name not in names_b:
                _all_below(pi, sub, si, out)
                changed = True
                continue
            pb = here_b / name
            sb = pb.lstat()
            if stat.S_ISDIR(si.st_mode) and stat.S_ISDIR(sb.st_mode):
                mark = len(out.entries)
                below = walk(sub)
                if below or not same(pi, pb, si, sb, sub):
                    out.entries.insert(mark, sub)
                    changed = True
            elif not same(pi, pb, si, sb, sub):
                _all_below(pi, sub, si, out)
                changed = True
        return changed

    walk("")
    return out


def _all_below(path: Path, rel: str, st: os.stat_result, out: Diff) -> None:
    out.entries.append(rel)
    if stat.S_ISDIR(st.st_mode):
        for name in sorted(os.listdir(path)):
            sub = path / name
            _all_below(sub, f"{rel}/{name}", sub.lstat(), out)


def _copy_attrs(src: Path, dest: Path, st: os.stat_result) -> None:
    if os.geteuid() == 0:  # (an ordinary user's layers get their owners by pseudo lines)
        os.chown(dest, st.st_uid, st.st_gid, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dest, stat.S_IMODE(st.st_mode))
    for key, value in _xattrs(src).items():
        try:
            os.setxattr(dest, key, value, follow_symlinks=False)
        except OSError:
            pass
    os.utime(dest, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def stage(image: Path, entries: list[str], whiteouts: list[str], dest: Path,
          owned: Owners | None = None) -> list[str]:
    """A folder ``dest`` holding ``entries`` of ``image`` (files hard-linked: same file
    system) and the parents they need, with the image's attributes; returns mksquashfs
    pseudo definitions of the ``whiteouts`` (and, with ``owned``, of every entry's owner
    and mode as recorded)."""
    dest.mkdir()
    _copy_attrs(image, dest, image.lstat())
    made = {""}
    folders: list[tuple[Path, Path, os.stat_result]] = [(image, dest, image.lstat())]

    def parents(rel: str) -> None:
        parts = rel.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            if sub not in made:
                make(sub)

    def make(rel: str) -> None:
        src, out = image / rel, dest / rel
        st = src.lstat()
        if stat.S_ISDIR(st.st_mode):
            out.mkdir()
            folders.append((src, out, st))  # attributes after their contents are made
        elif stat.S_ISREG(st.st_mode):
            os.link(src, out)
        elif stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(src), out)
            _copy_attrs(src, out, st)
        else:
            os.mknod(out, st.st_mode, st.st_rdev)
            _copy_attrs(src, out, st)
        made.add(rel)

    for rel in entries:
        parents(rel)
        if rel not in made:
            make(rel)
    pseudo = []
    for rel in whiteouts:
        parents(rel)
        pseudo.append(f"{_escaped(rel)} c 0 0 0 0 0")
    for src, out, st in reversed(folders):
        _copy_attrs(src, out, st)
    if owned is not None:
        pseudo += [f"{_escaped(rel)} m {owned[rel][0] & 0o7777:o} {owned[rel][1]} "
                   f"{owned[rel][2]}" for rel in sorted(made) if rel and rel in owned]
    return pseudo


def pack_layer(tree: Path, pseudo: list[str], out: Path, timeout: float,
               root: tuple[int, int, int] | None = None) -> None:
    """``tree`` (and the pseudo entries) as a reproducible squashfs file ``out``; ``root``:
    its root folder's (mode, uid, gid), else the tree's."""
    pf = out.with_name(out.name + ".pseudo")
    pf.write_text("".join(f"{p}\n" for p in pseudo))
    try:
        proc = subprocess.run(
            ["mksquashfs", str(tree), str(out), "-noappend", "-quiet", "-no-progress",
             "-comp", "gzip", "-Xcompression-level", "1", "-mkfs-time", "0",
             "-processors", str(min(os.cpu_count() or 1, 8))] +
            (["-pf", str(pf)] if pseudo else []) +
            (["-root-mode", f"{root[0] & 0o7777:o}", "-root-uid", str(root[1]),
              "-root-gid", str(root[2])] if root else []),
            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
            check=False)
    finally:
        pf.unlink(missing_ok=True)
    if proc.returncode != 0:
        raise BuildError("layers", f"mksquashfs: {proc.stderr.strip()[-1000:]}")


def split(image: Path, base: Path, work: Path, out: Path, timeout: float,
          owned: tuple[Owners, Owners] | None = None) -> list[Path]:
    """Layers of ``image`` (an unpacked root) over ``base`` (its base's), top first: the
    task's changes, then the verifier tools where the image has them; staged in ``work``
    (a fresh folder on ``image``'s file system), packed as squashfs files in ``out``.
    ``owned``: the owners and modes of both as recorded (``owners``), for roots unpacked
    by an ordinary user."""
    d = diff(image, base, owned)
    tools = [e for e in d.entries if e.split("/")[0] == TOOLS_TOP and e != TOOLS_UNMET]
    own = [e for e in d.entries if e.split("/")[0] != TOOLS_TOP or e == TOOLS_UNMET]
    layers = []
    for name, entries, whiteouts in (("task", own, d.whiteouts), ("tools", tools, [])):
        if name == "tools" and not entries:
            continue
        pseudo = stage(image, entries, whiteouts, work / name, owned and owned[0])
        root = owned[0].get("") if owned else None
        if name == "tools":  # its root is never seen (the task's is above): one for all
            os.chmod(work / name, 0o755)
            os.utime(work / name, (0, 0))
            root = (0o755, 0, 0) if owned else None
        pack_layer(work / name, pseudo, out / f"{name}.sqfs", timeout, root)
        layers.append(out / f"{name}.sqfs")
    return layers


PYTHON_NAME = re.compile(r"python(\d+(\.\d+)?)?")
"""The names uv looks for a Python by (python3-config and the like are not)."""


def pythons(image: Path, path: str) -> list[tuple[str, int]]:
    """(path, size) of each Python (``PYTHON_NAME``) in the folders of ``path`` (the
    image's PATH) of an unpacked root, links followed inside the root: what the verifier
    tools' build step can find of the image."""
    found = []
    for folder in dict.fromkeys(path.split(":")):
        here = image / folder.lstrip("/")
        if not folder.startswith("/") or not here.is_dir() or here.is_symlink():
            continue
        for entry in sorted(os.listdir(here)):
            if PYTHON_NAME.fullmatch(entry):
                target, hops = here / entry, 0
                while target.is_symlink() and hops < 8:
                    link = os.readlink(target)
                    target = (image / link.lstrip("/")) if link.startswith("/") else \
                        target.parent / link
                    hops += 1
                size = target.lstat().st_size if target.exists() or target.is_symlink() \
                    else -1
                found.append((f"{folder}/{entry}", size))
    return found


def tools_key_text(script: str) -> str:
    """The tools' build step as their shared layer's key reads it: the line numbers in its
    messages (``tests/test.sh:21: ...``, where a step failed) left out, so tasks whose
    scripts differ only in where the same lines sit share one layer (its ``unmet`` notes
    then name the first task's lines)."""
    return re.sub(r"(tests/[^\s:'\"]+):\d+:", r"\1:", script)


def base_root(base_sif: Path, cache_dir: Path) -> Path:
    """The base's root filesystem, extracted once per base into the node-local cache."""
    root = cache_dir / "base-rootfs" / base_sif.stem
    root.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root) + ".lock"):
        if not root.exists():
            sif.extract(base_sif, root, lenient=os.geteuid() != 0)
    return root


def split_sif(image_sif: Path, base_sif: Path, cache_dir: Path, out: Path,
              timeout: float, path: str = "") -> tuple[list[Path], list[tuple[str, int]]]:
    """``split`` of a built task SIF over its base's SIF (both unpacked in the node-local
    cache; the image's unpacked root removed after), and its ``pythons`` on ``path``."""
    build = cache_dir / "build"
    build.mkdir(parents=True, exist_ok=True)
    for old in build.glob("layers-*"):  # left by killed builds: none runs for 6 h
        with contextlib.suppress(FileNotFoundError):  # (another build's clean-up first)
            if time.time() - old.stat().st_mtime <= 6 * 3600:
                continue
            subprocess.run(["rm", "-rf", "--one-file-system", str(old)], timeout=600,
                           check=False)
    work = Path(tempfile.mkdtemp(prefix="layers-", dir=build))
    try:
        user = os.geteuid() != 0
        image = sif.extract(image_sif, work / "image", timeout=timeout, lenient=user)
        owned = (owners(image_sif, sif.read_partition(image_sif).offset, timeout),
                 owners(base_sif, sif.read_partition(base_sif).offset, timeout)) \
            if user else None
        return split(image, base_root(base_sif, cache_dir), work, out, timeout, owned), \
            pythons(image, path or DEFAULT_PATH)
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(work)], timeout=600,
                       check=False)
