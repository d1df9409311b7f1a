"""bubblewrap command lines.

A ``BwrapSpec`` says what a sandbox sees; ``argv()`` turns it into a bwrap command. Every
sandbox gets fresh pid, ipc, uts, cgroup and (unless ``network``) net namespaces, a new
session (no terminal injection), a clean environment, and dies with the process that
started it. Nothing of the host is visible except what the spec binds.

``host_root()`` builds a spec over this machine's own root filesystem, read-only, with the
user's and the project's directories (/root, /home, /work, /mnt...) hidden: the quick
pre-image check of a task uses it. Images (tmax images) replace it with the image's root.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Top-level host entries bound read-only by host_root(); everything else stays hidden.
HOST_SYSTEM_DIRS = ("usr", "etc", "var", "lib", "lib32", "lib64", "libx32", "bin", "sbin")


@dataclass
class BwrapSpec:
    ro_binds: list[tuple[str, str]] = field(default_factory=list)
    """(host path, sandbox path) pairs mounted read-only."""
    binds: list[tuple[str, str]] = field(default_factory=list)
    """(host path, sandbox path) pairs mounted read-write."""
    root_binds: list[tuple[str, str]] = field(default_factory=list)
    """(host path, sandbox path) pairs mounted read-write right after the root, before
    everything else (the entries of a root assembled from parts)."""
    symlinks: list[tuple[str, str]] = field(default_factory=list)
    """(target, sandbox path): symlinks created in the sandbox."""
    tmpfs: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=lambda: {"PATH": DEFAULT_PATH, "HOME": "/root"})
    cwd: str = "/"
    network: bool = False
    hostname: str = "sandbox"
    root: str | None = None
    """Host directory bound read-write as the sandbox's / (default: an empty tmpfs)."""
    extra_args: list[str] = field(default_factory=list)
    """More bwrap options, placed just before the command."""

    def argv(self, command: list[str]) -> list[str]:
        args = ["bwrap"] + (["--bind", self.root, "/"] if self.root else ["--tmpfs", "/"])
        for src, dst in self.root_binds:
            args += ["--bind", src, dst]
        for target, link in self.symlinks:
            args += ["--symlink", target, link]
        for src, dst in self.ro_binds:
            args += ["--ro-bind", src, dst]
        for src, dst in self.binds:
            args += ["--bind", src, dst]
        args += ["--dev", "/dev", "--proc", "/proc"]
        for path in self.tmpfs:
            args += ["--tmpfs", path]
        args += ["--unshare-all"] + (["--share-net"] if self.network else [])
        args += ["--hostname", self.hostname, "--die-with-parent", "--new-session",
                 "--clearenv"]
        for key, value in self.env.items():
            args += ["--setenv", key, value]
        args += [*self.extra_args, "--chdir", self.cwd, "--"]
        return args + list(command)


def host_root(host: Path = Path("/")) -> BwrapSpec:
    """This machine's system directories, read-only; symlinked ones (usr-merge) as links."""
    spec = BwrapSpec()
    for name in HOST_SYSTEM_DIRS:
        path = host / name
        if path.is_symlink():
            spec.symlinks.append((os.readlink(path), f"/{name}"))
        elif path.is_dir():
            spec.ro_binds.append((str(path), f"/{name}"))
    return spec
