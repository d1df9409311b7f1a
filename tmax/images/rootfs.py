"""Root filesystems for the local builder: debootstrap a base, run build steps in a chroot.

Build steps (%post, a Dockerfile's RUN lines) run in a bubblewrap sandbox whose root is the
image's root filesystem, read-write, as root inside, with fresh namespaces; the network is
shared only when asked (bases need it for apt; task layers get it like `docker build` does).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from tmax.images.definition import Definition

SINGULARITY_ENV = ".singularity.d/env/90-environment.sh"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class BuildError(Exception):
    """A build step failed; ``log`` is the build log's path."""

    def __init__(self, what: str, reason: str, log: Path | None = None):
        self.what, self.reason, self.log = what, reason, log
        super().__init__(f"{what}: {reason}" + (f" (log: {log})" if log else ""))


def apt_mirror(suite: str = "bookworm", apt_dir: Path = Path("/etc/apt")) -> str:
    """The Debian mirror this machine's apt uses for ``suite`` (deb822 or one-line sources)."""
    candidates: list[tuple[str, list[str]]] = []
    sources = [apt_dir / "sources.list"] + sorted((apt_dir / "sources.list.d").glob("*"))
    for path in sources:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        if path.suffix == ".sources":
            for stanza in re.split(r"\n\s*\n", text):
                fields = {}
                for line in stanza.splitlines():
                    if ":" in line and not line.lstrip().startswith("#"):
                        key, _, value = line.partition(":")
                        fields[key.strip().lower()] = value.split()
                if "deb" in fields.get("types", []) and fields.get("enabled", ["yes"]) != ["no"]:
                    for uri in fields.get("uris", []):
                        candidates.append((uri, fields.get("suites", [])))
        elif path.suffix == ".list":
            for line in text.splitlines():
                parts = re.sub(r"\[[^]]*\]", "", line).split()
                if len(parts) >= 3 and parts[0] == "deb":
                    candidates.append((parts[1], [parts[2]]))
    for uri, suites in candidates:
        if suite in suites:
            return uri.rstrip("/")
    raise BuildError("apt mirror", f"no deb source for suite {suite!r} in {apt_dir}: "
                     "configure apt, or pass --mirror")


def run_logged(argv: list[str], log: Path, timeout: float, what: str) -> None:
    with open(log, "a") as out:
        out.write(f"$ {' '.join(argv)}\n")
        out.flush()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            import os
            import signal

            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise BuildError(what, f"timed out after {timeout:g}s", log) from None
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise BuildError(what, f"exit {code}:\n" + "\n".join(tail), log)


def chroot_argv(rootfs: Path, command: list[str], *, network: bool, env: dict[str, str],
                cwd: str = "/") -> list[str]:
    argv = ["bwrap", "--bind", str(rootfs), "/", "--dev", "/dev", "--proc", "/proc",
            "--tmpfs", "/tmp", "--unshare-all", "--die-with-parent", "--new-session",
            "--hostname", "build", "--clearenv"]
    if network:
        argv[argv.index("--unshare-all") + 1:argv.index("--unshare-all") + 1] = ["--share-net"]
        if Path("/etc/resolv.conf").exists():
            argv += ["--ro-bind", "/etc/resolv.conf", "/etc/resolv.conf"]
    for key, value in {"PATH": DEFAULT_PATH, "HOME": "/root", **env}.items():
        argv += ["--setenv", key, value]
    return argv + ["--chdir", cwd, "--"] + command


def environment_of(definition: Definition) -> dict[str, str]:
    """The variables %environment exports (evaluated by sh, no host environment)."""
    script = definition.sections.get("environment", "")
    if not script.strip():
        return {}
    proc = subprocess.run(["sh", "-c", f"{script}\nenv -0"], capture_output=True, text=True,
                          env={"PATH": DEFAULT_PATH}, timeout=10, check=False)
    env = {}
    for item in proc.stdout.split("\0"):
        key, sep, value = item.partition("=")
        if sep and key not in ("PWD", "SHLVL", "_", "OLDPWD"):
            env[key] = value
    return env


def finish_rootfs(rootfs: Path, definition: Definition) -> None:
    """Apptainer's metadata layout, so the SIF runs under Apptainer unchanged."""
    meta = rootfs / ".singularity.d"
    for sub in ("env", "actions", "libs"):
        (meta / sub).mkdir(parents=True, exist_ok=True)
    env_file = rootfs / SINGULARITY_ENV
    script = definition.sections.get("environment", "")
    previous = env_file.read_text() if env_file.exists() else "#!/bin/sh\n"
    if script.strip():
        env_file.write_text(previous + script.rstrip() + "\n")
    elif not env_file.exists():
        env_file.write_text(previous)
    runscript = meta / "runscript"
    if not runscript.exists():
        runscript.write_text("#!/bin/sh\nexec /bin/bash \"$@\"\n")
        runscript.chmod(0o755)
    for name in ("etc/hosts", "etc/resolv.conf", "etc/localtime"):
        (rootfs / name).parent.mkdir(parents=True, exist_ok=True)
        if not (rootfs / name).exists() and not (rootfs / name).is_symlink():
            (rootfs / name).touch()


def debootstrap_base(definition: Definition, dest: Path, mirror: str, log: Path,
                     timeout: float = 1800) -> Path:
    """Bootstrap a base root filesystem from a ``Bootstrap: debootstrap`` definition."""
    if definition.header.get("bootstrap", "").lower() != "debootstrap":
        raise BuildError("base", "the local builder makes bases only with Bootstrap: debootstrap")
    suite = definition.header.get("osversion", "bookworm")
    include = ",".join(definition.header.get("include", "").split())
    argv = ["debootstrap", "--variant=minbase"] + ([f"--include={include}"] if include else [])
    run_logged(argv + [suite, str(dest), mirror], log, timeout, "debootstrap")
    post = definition.sections.get("post", "")
    if post.strip():
        run_logged(chroot_argv(dest, ["/bin/sh", "-ec", post], network=True, env={}), log,
                   timeout, "%post")
    finish_rootfs(dest, definition)
    return dest


def copy_tree(src: Path, dest: Path) -> None:
    """cp -a (reflinks where the filesystem has them); keeps owners, modes, links."""
    subprocess.run(["cp", "-a", "--reflink=auto", f"{src}/.", str(dest)], check=True,
                   timeout=1800)


def remove_tree(path: Path) -> None:
    if path.exists():
        subprocess.run(["rm", "-rf", "--one-file-system", str(path)], timeout=600, check=False)
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)
