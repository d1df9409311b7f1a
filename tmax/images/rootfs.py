"""Root filesystems for the local builder: debootstrap a base, run build steps in a chroot.

Build steps (%post, a Dockerfile's RUN lines) run in a bubblewrap sandbox whose root is the
image's root filesystem, read-write, as root inside, with fresh namespaces; the network is
shared only when asked (bases need it for apt; task layers get it like `docker build` does).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import select
import signal
import subprocess
import tempfile
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tmax.images.types import DEFAULT_PATH, BuildError, Definition

SINGULARITY_ENV = ".singularity.d/env/90-environment.sh"


def _sources(apt_dir: Path) -> list[tuple[str, list[str]]]:
    """(uri, suites) of each deb source in ``apt_dir`` (deb822 or one-line)."""
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
    return candidates


def _listed_mirror(suite: str, apt_dir: Path) -> str:
    for uri, suites in _sources(apt_dir):
        if suite in suites:
            return uri.rstrip("/")
    raise LookupError(suite)


def apt_mirror(suite: str = "bookworm", apt_dir: Path = Path("/etc/apt")) -> str:
    """The Debian mirror this machine's apt uses for ``suite`` (deb822 or one-line sources);
    a suite that is not listed falls back to the mirror of a listed Debian release (the
    same archive serves all of them: a machine on bookworm builds trixie bases). Ubuntu
    suites: ``ubuntu_mirror``."""
    if is_ubuntu(suite):
        return ubuntu_mirror(apt_dir)
    try:
        return _listed_mirror(suite, apt_dir)
    except LookupError:
        pass
    releases = {"buster", "bullseye", "bookworm", "trixie", "forky", "sid", "oldstable",
                "stable", "testing", "unstable"}  # the archive's own (not -security, vendors')
    for uri, suites in _sources(apt_dir):  # one Debian archive serves every release
        if releases & set(suites):
            return uri.rstrip("/")
    raise BuildError("apt mirror", f"no deb source for suite {suite!r} (nor for any other "
                     f"Debian release) in {apt_dir}: configure apt, or pass --mirror")


# Ubuntu releases a base may bootstrap (debootstrap's own scripts); their packages come from
# Ubuntu's archive, not the Debian mirror.
UBUNTU_SUITES = frozenset({"bionic", "focal", "jammy", "noble", "oracular", "plucky",
                           "questing"})
UBUNTU_MIRROR_ENV = "TMAX_UBUNTU_MIRROR"
DEBOOTSTRAP_SCRIPTS = Path("/usr/share/debootstrap/scripts")
UBUNTU_KEYRING = Path("/usr/share/keyrings/ubuntu-archive-keyring.gpg")
# Where there is no Ubuntu keyring on the host (Debian has no ubuntu-keyring package), the
# keyring comes from this package of noble's release pocket, which never changes; it is used
# only when its SHA-256 is this one.
UBUNTU_KEYRING_DEB = ("pool/main/u/ubuntu-keyring/ubuntu-keyring_2023.11.28.1_all.deb",
                      "36de43b15853ccae0028e9a767613770c704833f82586f28eb262f0311adb8a8")


def is_ubuntu(suite: str) -> bool:
    return suite in UBUNTU_SUITES


def ubuntu_mirror(apt_dir: Path = Path("/etc/apt")) -> str:
    """The Ubuntu archive for Ubuntu bases: ``$TMAX_UBUNTU_MIRROR``, else the one this
    machine's apt lists (an Ubuntu host), else Ubuntu's own (ports.ubuntu.com off x86)."""
    if os.environ.get(UBUNTU_MIRROR_ENV):
        return os.environ[UBUNTU_MIRROR_ENV].rstrip("/")
    for uri, suites in _sources(apt_dir):  # the archive itself, not a vendor's or a PPA's
        if UBUNTU_SUITES & set(suites) and \
                uri.rstrip("/").endswith(("/ubuntu", "/ubuntu-ports")) and "ppa" not in uri:
            return uri.rstrip("/")
    if platform.machine() in ("x86_64", "i686", "i386", "AMD64"):
        return "http://archive.ubuntu.com/ubuntu"
    return "http://ports.ubuntu.com/ubuntu-ports"


def ubuntu_keyring(cache_dir: Path, mirror: str, log: Path, timeout: float = 300) -> Path:
    """The keyring debootstrap checks an Ubuntu archive with: the host's (ubuntu-keyring),
    else one taken once from Ubuntu's keyring package (pinned by its SHA-256) into
    ``cache_dir``."""
    if UBUNTU_KEYRING.is_file():
        return UBUNTU_KEYRING
    kept = Path(cache_dir) / "keyrings" / "ubuntu-archive-keyring.gpg"
    if kept.is_file():
        return kept
    path, digest = UBUNTU_KEYRING_DEB
    url = f"{mirror}/{path}"
    with open(log, "a") as out:
        out.write(f"fetching Ubuntu's archive keyring: {url}\n")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            data = response.read()
    except OSError as e:
        raise BuildError("ubuntu keyring", f"cannot fetch {url} ({e}): install Ubuntu's "
                         f"archive keyring as {UBUNTU_KEYRING} (package ubuntu-keyring), or "
                         f"set ${UBUNTU_MIRROR_ENV} to a mirror that has it", log) from None
    if hashlib.sha256(data).hexdigest() != digest:
        raise BuildError("ubuntu keyring", f"{url} is not the expected package (SHA-256 "
                         f"{hashlib.sha256(data).hexdigest()}, want {digest}): install "
                         f"Ubuntu's archive keyring as {UBUNTU_KEYRING} yourself", log)
    kept.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=kept.parent) as tmp:
        deb = Path(tmp) / "keyring.deb"
        deb.write_bytes(data)
        run_logged(["dpkg-deb", "-x", str(deb), f"{tmp}/x"], log, timeout, "ubuntu keyring")
        os.replace(f"{tmp}/x/usr/share/keyrings/ubuntu-archive-keyring.gpg", kept)
    return kept


def run_logged(argv: list[str], log: Path, timeout: float, what: str, *,
               pass_fds: tuple[int, ...] = (),
               started: Callable[[subprocess.Popen], None] | None = None) -> None:
    """Run ``argv`` with its output appended to ``log``; ``BuildError`` (with the log's
    tail) when it fails or runs past ``timeout``. ``started`` runs once it has started."""
    with open(log, "a") as out:
        out.write(f"$ {' '.join(argv)}\n")
        out.flush()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                pass_fds=pass_fds)
        try:
            if started is not None:
                started(proc)
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise BuildError(what, f"timed out after {timeout:g}s", log) from None
        except BaseException:  # ``started`` failed, or we were interrupted: none left behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise BuildError(what, f"exit {code}:\n" + "\n".join(tail), log)


def chroot_argv(rootfs: Path, command: list[str], *, network: bool, env: dict[str, str],
                cwd: str = "/", info_fd: int | None = None, block_fd: int | None = None
                ) -> list[str]:
    """bwrap with ``rootfs`` as its root, read-write. With ``info_fd``/``block_fd`` (see
    ``run_in_rootfs``) it gets a user namespace of its own whose map the caller writes."""
    argv = ["bwrap", "--bind", str(rootfs), "/", "--dev", "/dev", "--proc", "/proc",
            "--perms", "1777", "--tmpfs", "/tmp", "--die-with-parent", "--new-session",
            "--hostname", "build", "--clearenv"]
    if info_fd is not None and block_fd is not None:
        argv += ["--unshare-user", "--uid", "0", "--gid", "0", "--userns-block-fd",
                 str(block_fd), "--info-fd", str(info_fd)]
    else:
        argv += ["--unshare-user-try"]
    argv += ["--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try"]
    if not network:
        argv += ["--unshare-net"]
    elif Path("/etc/resolv.conf").exists():
        argv += ["--ro-bind", "/etc/resolv.conf", "/etc/resolv.conf"]
    for key, value in {"PATH": DEFAULT_PATH, "HOME": "/root", **env}.items():
        argv += ["--setenv", key, value]
    return argv + ["--chdir", cwd, "--"] + command


ID_MAP = "0 0 65536\n"
"""Build steps' user namespace: uids and gids 0-65535 as themselves, so a step can add
users, chown to them and drop to them (apt's _apt sandbox, useradd, USER), and what it
writes has the owners the image records; root inside has capabilities over its own
namespaces only."""


def run_in_rootfs(rootfs: Path, command: list[str], log: Path, timeout: float, what: str, *,
                  network: bool, env: dict[str, str] | None = None, cwd: str = "/") -> None:
    """Run a build step in ``rootfs`` (see ``chroot_argv``), its output in ``log``; as root
    in a user namespace mapped by ``ID_MAP`` when this process is root (else bwrap's own)."""
    if os.geteuid() != 0:
        run_logged(chroot_argv(rootfs, command, network=network, env=env or {}, cwd=cwd),
                   log, timeout, what)
        return
    info_r, info_w = os.pipe()
    block_r, block_w = os.pipe()
    open_fds = {info_r, info_w, block_r, block_w}

    def close(fd: int) -> None:  # each exactly once: builds run in threads, and a number
        if fd in open_fds:       # closed twice may by then be another thread's file
            open_fds.discard(fd)
            os.close(fd)

    argv = chroot_argv(rootfs, command, network=network, env=env or {}, cwd=cwd,
                       info_fd=info_w, block_fd=block_r)

    def map_ids(proc: subprocess.Popen) -> None:
        close(info_w)
        close(block_r)
        data = b""
        while True:
            ready, _, _ = select.select([info_r], [], [], 60)
            chunk = os.read(info_r, 4096) if ready else b""
            if not chunk:
                return  # bwrap failed early: its message is in the log
            data += chunk
            try:
                child = json.loads(data)["child-pid"]
                break
            except ValueError:
                continue
        for name in ("uid_map", "gid_map"):
            Path(f"/proc/{child}/{name}").write_text(ID_MAP)
        os.write(block_w, b"1")

    try:
        run_logged(argv, log, timeout, what, pass_fds=(info_w, block_r), started=map_ids)
    finally:
        for fd in sorted(open_fds):
            close(fd)


def environment_of(definition: Definition, path: str = DEFAULT_PATH) -> dict[str, str]:
    """The variables %environment exports (evaluated by sh, no host environment; PATH
    ``path`` before it runs)."""
    script = definition.sections.get("environment", "")
    if not script.strip():
        return {}
    proc = subprocess.run(["sh", "-c", f"{script}\nenv -0"], capture_output=True, text=True,
                          env={"PATH": path}, timeout=10, check=False)
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
                     timeout: float = 1800, keyring: Path | None = None) -> Path:
    """Bootstrap a base root filesystem from a ``Bootstrap: debootstrap`` definition
    (``keyring``: the archive's, where the host's default is not it: Ubuntu's)."""
    if definition.header.get("bootstrap", "").lower() != "debootstrap":
        raise BuildError("base", "the local builder makes bases only with Bootstrap: debootstrap")
    suite = definition.header.get("osversion", "bookworm")
    include = ",".join(definition.header.get("include", "").split())
    argv = ["debootstrap", "--variant=minbase"] + ([f"--include={include}"] if include else [])
    argv += [f"--keyring={keyring}"] if keyring else []
    script = []
    if is_ubuntu(suite) and not (DEBOOTSTRAP_SCRIPTS / suite).exists():
        script = [str(DEBOOTSTRAP_SCRIPTS / "gutsy")]  # every Ubuntu release's (an older
        # debootstrap does not list the newer ones)
    run_logged(argv + [suite, str(dest), mirror, *script], log, timeout, "debootstrap")
    post = definition.sections.get("post", "")
    if post.strip():
        run_in_rootfs(dest, ["/bin/sh", "-ec", post], log, timeout, "%post", network=True)
    finish_rootfs(dest, definition)
    return dest


def copy_tree(src: Path, dest: Path) -> None:
    """cp -a (reflinks where the filesystem has them); keeps owners, modes, links."""
    subprocess.run(["cp", "-a", "--reflink=auto", f"{src}/.", str(dest)], check=True,
                   timeout=1800)
