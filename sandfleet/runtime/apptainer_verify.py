"""The verifier on Apptainer: a fresh container of the sandbox's SIF over the agent's final
files, with the image's system folders over the agent's.

``verify_in_fresh_container`` (``ApptainerRuntime.verify``):

1. The agent's instance is stopped: every agent process ends (none can watch, signal or
   write to the verifier), its mounts go, its overlay is flushed and unmounted.
2. The verifier is ``apptainer exec`` of the same SIF with the agent's overlay image as a
   read-only layer under a tmpfs of its own (``--overlay <img>:ro --writable-tmpfs``), in
   new pid, ipc, mount and user namespaces, the sandbox's network setting and limits. Over
   that, read-only, from the image as built (``pristine_squashfs``: the SIF's squashfs as a
   file of its own, since Apptainer binds ``image-src`` only from a data partition or a
   plain image): each ``PRISTINE`` top-level folder (a link in the image, as merged-/usr's
   /bin, gets the folder it names), the ``PRISTINE_ETC`` entries of /etc the image has,
   empty files for the loader's ``LOADER_ETC`` files it lacks, and the verifier tools
   (``VERIFIER_TOOLS``, which the agent's overlay hides by a whiteout). /tests is a
   copy of the task's tests and /logs/verifier a folder, both on the host, private to this
   call: only the verifier writes them; the reward is read from that folder. /tmp and
   /var/tmp are the agent's overlay's (``--no-mount tmp``, as for the instance).
   Over those, the plan's view as far as ``--bind`` and the ``env`` prefix give it
   (``apptainer_plan``): the image's PATH folders outside /usr (a top-level venv too),
   read-only; TMax's PYTHONPATH guard; uv's installer stand-in over $HOME/.local/bin;
   uv's installed Pythons and curl's configuration the image's or none.
3. The instance is started again over the same overlay (the agent's files as it left them;
   its processes, services included, are gone), with the sandbox's remaining lifetime.

What it does not give, as the local runtime does (``NOT_GUARANTEED``): a service the agent
left running is not there for the verifier (its processes end at step 1); the image's
PATH folders are read-only, not under a writable layer of the verifier's; the agent's
other files in $HOME/.local/bin are hidden from the verifier; the verifier runs as the
instance's one user, not the task's [verifier] user; an agent root of files set aside (a
/conftest.py) is seen as the agent left it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from sandfleet.runtime import layers, sif
from sandfleet.runtime.apptainer_plan import probe, verifier_view
from sandfleet.runtime.base import ExecResult, SandboxSpec, run_capture
from sandfleet.verifier.plan import (
    LOADER_ETC,
    PRISTINE,
    PRISTINE_ETC,
    PRISTINE_ETC_PREFIXES,
    VERIFIER_ENV,
    VERIFIER_TOOLS,
)

log = logging.getLogger(__name__)

NOT_GUARANTEED = [
    ("verifier: a service the agent left running is not reachable (the agent's processes "
    "all end before the verifier starts)"),
    ("verifier: the image's PATH folders outside /usr (/opt/venv, a top-level /venv) are "
     "bound read-only (a pip install into them fails); files the agent left at / (a "
     "/conftest.py) are not set aside; the agent's own files in $HOME/.local/bin are hidden "
     "where the uv installer stand-in is bound; a link the agent left at $HOME, "
     "$HOME/.local/bin or a PATH folder's place is followed by the binds (the verifier "
     "reads the bound files through it)"),
    ("verifier: an /etc entry of the image that the agent removed (rm -rf /etc/apt), or a "
     "PATH folder's place it made a link to a path not inside, leaves the bind of the "
     "image's copy no destination: the verifier's container does not start (exit 255, no "
     "reward); /tests is a bind mount (a test.sh cannot move it away and back)"),
    ("verifier: what the agent installed into the system folders (apt-get install, pip "
     "install into the system Python) is not seen: the image's /usr, /bin, /lib are bound "
     "whole (the local runtime stacks the agent's additions below them: "
     "sandfleet.verifier.additions); a task graded on such work needs [verifier] "
     "agent_system there"),
]

# Lists the image's entries the verifier takes from it: "<kind> <path> [<link target>]".
ENTRIES_SH = r"""
for p in "$@" /etc/python3.* /etc/ld-musl-*; do
  if [ -L "$p" ]; then echo "link $p $(readlink "$p")"
  elif [ -d "$p" ]; then echo "dir $p"
  elif [ -e "$p" ]; then echo "file $p"
  fi
done
"""


PRISTINE_CACHE_GB = float(os.environ.get("SANDFLEET_PRISTINE_CACHE_GB", "20"))
"""What the pristine squashfs files of a node's runtime may take: past it, those unused for
an hour or more go, least recently used first (a node sees thousands of task images)."""


def trim_cache(cache: Path, limit_bytes: float, min_age_s: float = 3600) -> list[Path]:
    """Remove the least recently used ``*.sqfs`` of ``cache`` (and their listings, the
    files named ``<key>.*``) until the rest fit ``limit_bytes``; one used (its mtime
    refreshed) within ``min_age_s`` stays: a verify may be about to bind it."""
    found = []
    for path in cache.glob("*.sqfs"):
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        found.append((st.st_mtime, st.st_size, path))
    total, removed, now = sum(size for _, size, _ in found), [], time.time()
    for mtime, size, path in sorted(found):
        if total <= limit_bytes:
            break
        if now - mtime < min_age_s:
            continue
        for sibling in cache.glob(f"{path.stem}.*"):
            sibling.unlink(missing_ok=True)
        total -= size
        removed.append(path)
    return removed


def _used(dest: Path) -> Path:
    os.utime(dest)  # (``trim_cache`` keeps what was used last)
    return dest


def pristine_squashfs(cache: Path, image: Path, nice: int = 0) -> Path:
    """The SIF's squashfs partition as a file of its own in ``cache``, made once per image
    version (keyed by path, size and mtime); a layered image's layers merged (at ``nice``)."""
    if layers.is_layered(image):  # the layers merged, once per node and image version
        key = hashlib.sha1(json.dumps(layers.identity(image)).encode()).hexdigest()[:16]
        dest = cache / f"{key}.sqfs"
        with _MERGING_LOCK:
            lock = _MERGING.setdefault(dest, threading.Lock())
        with lock:  # one merge per image (``merge_ahead``'s, or this call's)
            if dest.exists():
                return _used(dest)
            layers.flatten(image, dest, nice=nice)
        trim_cache(cache, PRISTINE_CACHE_GB * 2**30)
        return dest
    part = sif.read_partition(image)
    st = image.stat()
    key = hashlib.sha1(f"{image.resolve()}:{st.st_size}:{st.st_mtime_ns}:{part.offset}"
                       .encode()).hexdigest()[:16]
    dest = cache / f"{key}.sqfs"
    if dest.exists():
        return _used(dest)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
    with open(image, "rb") as src, open(tmp, "wb") as out:
        offset, left = part.offset, part.size
        while left:
            n = os.copy_file_range(src.fileno(), out.fileno(), left, offset)
            if n <= 0:
                raise OSError(f"{image}: short read copying its squashfs")
            offset, left = offset + n, left - n
    os.replace(tmp, dest)
    trim_cache(cache, PRISTINE_CACHE_GB * 2**30)
    return dest


_MERGING: dict[Path, threading.Lock] = {}
_MERGING_LOCK = threading.Lock()
_AHEAD: set[tuple[Path, Path]] = set()
_AHEAD_ONE = threading.Lock()


def merge_ahead(cache: Path, image: Path) -> None:
    """Make a layered image's merged squashfs (``pristine_squashfs``) in a thread of its
    own, while the agent works: a sandbox's first verify then finds it made (a merge of a
    base's 300 MB root takes seconds). Nothing for a SIF (its partition is copied out)."""
    if not layers.is_layered(image) or (cache, image) in _AHEAD:
        return
    _AHEAD.add((cache, image))  # (a file replaced at this path: its verify merges it)

    def merge() -> None:
        try:
            with _AHEAD_ONE:  # one at a time, at nice 19: the node's sandboxes come first
                pristine_squashfs(cache, image, nice=19)
        except (OSError, sif.SifError, subprocess.SubprocessError) as e:  # verify retries
            log.warning("merging the layers of %s ahead of its verify: %s", image, e)

    threading.Thread(target=merge, name="merge-layers", daemon=True).start()


def image_entries(apptainer: str, image: Path, cache: Path, env: dict[str, str],
                  timeout: float) -> list[tuple[str, str, str]]:
    """(kind, path, link target) of the image's PRISTINE and /etc entries and verifier
    tools, read once per image version by running the image itself."""
    squash = pristine_squashfs(cache, image)
    paths = [f"/{name}" for name in PRISTINE] + [f"/etc/{name}" for name in PRISTINE_ETC] \
        + [VERIFIER_TOOLS]
    key = hashlib.sha1("\0".join(paths + list(PRISTINE_ETC_PREFIXES)).encode()).hexdigest()
    listing = squash.with_suffix(f".entries-{key[:8]}.json")  # (a new PRISTINE_ETC: anew)
    if listing.exists():
        return [tuple(e) for e in json.loads(listing.read_text())]
    out = subprocess.run([apptainer, "exec", "--containall", "--no-home", "--userns",
                          *layers.apptainer_args(image), "sh", "-c", ENTRIES_SH, "sh", *paths],
                         capture_output=True, text=True, env=env, timeout=timeout,
                         stdin=subprocess.DEVNULL, check=False)
    if out.returncode != 0:
        raise OSError(f"listing {image} failed ({out.returncode}): {out.stderr[-800:]}")
    entries = []
    for line in out.stdout.splitlines():
        kind, path, *target = line.split(" ", 2)
        if kind in ("dir", "file", "link") and (
                path in paths or path.startswith(tuple(f"/etc/{p}"
                                                       for p in PRISTINE_ETC_PREFIXES))):
            entries.append((kind, path, target[0] if target else ""))
    tmp = listing.with_name(f".{listing.name}.{os.getpid()}")
    tmp.write_text(json.dumps(entries))
    os.replace(tmp, listing)
    return entries


def pristine_binds(squash: Path, entries: list[tuple[str, str, str]], empty: Path,
                   agent_system: bool) -> list[str]:
    """``--bind`` arguments putting the image's entries over the agent's."""
    binds, have = [], {path for _, path, _ in entries}
    for kind, path, target in entries:
        if path == VERIFIER_TOOLS or not agent_system:
            # a link (merged-/usr's /bin -> usr/bin): the folder it names in the image
            source = os.path.normpath(os.path.join(os.path.dirname(path), target)) \
                if kind == "link" else path
            binds += ["--bind", f"{squash}:{path}:image-src={source},ro"]
    if not agent_system:
        for name in LOADER_ETC:
            if f"/etc/{name}" not in have:
                binds += ["--bind", f"{empty}:/etc/{name}:ro"]
    return binds


def verify_argv(apptainer: str, spec: SandboxSpec, overlay: Path, binds: list[str],
                tests: Path, logs: Path, command: list[str], *, cwd: str,
                env: dict[str, str], rootless: bool, cgroup_limits: bool,
                cpus: tuple[int, ...]) -> list[str]:
    argv = (["taskset", "-c", ",".join(map(str, cpus))] if cpus else []) + [
        apptainer, "--quiet", "exec", "--writable-tmpfs", "--containall",
        "--cleanenv", "--no-home", "--no-mount", "tmp", "--hostname", spec.hostname,
        "--pwd", cwd,
        *(["--userns", "--fakeroot"] if rootless else ["--userns"])]
    if not spec.network:
        argv += ["--net", "--network", "none"]
    if cgroup_limits:
        argv += ["--cpus", str(spec.cpus), "--memory", f"{spec.memory_mb}M"]
    argv += [*binds, "--bind", f"{tests}:/tests", "--bind", f"{logs}:/logs/verifier"]
    setenv = ["env", *(f"{k}={v}" for k, v in env.items())]
    *below, base = layers.apptainer_args(spec.image)  # the agent's overlay over the layers
    return argv + [*below, "--overlay", f"{overlay}:ro", base, *setenv, *command]


MISSING_DESTINATION = re.compile(r"destination \S+ doesn't exist in container")
"""Apptainer's refusal of a ``--bind`` whose destination the agent removed."""

MEND_SH = ('for a; do p=${a#?:}; [ -e "$p" ] || [ -L "$p" ] || case $a in '
           'd:*) mkdir -p "$p";; *) mkdir -p "${p%/*}" && : > "$p";; esac; done')
"""Makes each missing destination (``d:PATH`` a folder, ``f:PATH`` a file) over the
agent's files; what is there, a link included, stays (the table's "followed" row)."""


def bind_destinations(argv: list[str], entries: list[tuple[str, str, str]]
                      ) -> list[str]:
    """``d:DEST`` / ``f:DEST`` for each ``--bind`` of ``argv``: a folder where the image's
    entry (``image-src``) or the host source is one."""
    kinds = {path: kind for kind, path, _ in entries}
    out = []
    for flag, value in itertools.pairwise(argv):
        if flag != "--bind":
            continue
        source, dest, *opts = value.split(":")
        folder = (kinds.get(dest) in ("dir", "link") if any(o.startswith("image-src=")
                                                             for o in opts)
                  else Path(source).is_dir())
        out.append(("d:" if folder else "f:") + dest)
    return out


def mend_argv(apptainer: str, spec: SandboxSpec, overlay: Path, destinations: list[str],
              rootless: bool) -> list[str]:
    """A container over the agent's overlay, writable, that makes the missing ones."""
    return [apptainer, "--quiet", "exec", "--overlay", str(overlay), "--containall",
            "--cleanenv", "--no-home", "--no-mount", "tmp", "--net", "--network", "none",
            *(["--userns", "--fakeroot"] if rootless else ["--userns"]),
            *layers.apptainer_args(spec.image), "/bin/sh", "-c", MEND_SH, "mend",
            *destinations]


def _copy_plain(src: Path, dest: Path) -> None:
    """Regular files and folders of ``src`` into ``dest``; links and devices the verifier
    left are skipped (never followed on the host)."""
    dest.mkdir(parents=True, exist_ok=True)
    for entry in os.scandir(src):
        target = dest / entry.name
        if entry.is_dir(follow_symlinks=False):
            _copy_plain(Path(entry.path), target)
        elif entry.is_file(follow_symlinks=False):
            shutil.copyfile(entry.path, target, follow_symlinks=False)


def verify_in_fresh_container(runtime: Any, sandbox_id: str, command: list[str], *,
                              tests: Path, logs: Path, timeout: float, cwd: str | None,
                              env: dict[str, str] | None, agent_system: bool
                              ) -> ExecResult:
    """See the module doc; ``runtime`` is the ``ApptainerRuntime`` of the sandbox."""
    record = runtime._live(sandbox_id)
    spec = SandboxSpec.from_dict(record.spec)
    info = runtime.info
    home = runtime._dir(sandbox_id)
    cache = runtime.state_dir / "pristine"
    entries = image_entries(runtime.apptainer, spec.image, cache, runtime._env,
                            runtime.start_timeout_s)
    squash = pristine_squashfs(cache, spec.image)
    runtime._end_instance(sandbox_id, record)
    try:
        with tempfile.TemporaryDirectory(prefix="verify-", dir=home) as tmp:
            work = Path(tmp)
            shutil.copytree(tests, work / "tests", symlinks=True)
            (work / "logs").mkdir()
            (work / "empty").write_text("")
            for path in (work, work / "tests", work / "logs"):
                path.chmod(0o755)
            binds = pristine_binds(squash, entries, work / "empty", agent_system)
            view, verifier_env = verifier_view(
                lambda paths: probe(runtime.apptainer, spec.image, squash, runtime._env,
                                    runtime.start_timeout_s, paths),
                squash, work, {**VERIFIER_ENV, **spec.env, **(env or {})},
                workdir=spec.workdir, cwd=cwd, agent_system=agent_system)
            argv = verify_argv(runtime.apptainer, spec, home / "overlay.img", binds + view,
                               work / "tests", work / "logs", command,
                               cwd=cwd or spec.workdir, env=verifier_env,
                               rootless=info.rootless, cgroup_limits=runtime.cgroup_limits,
                               cpus=record.cpus)
            output, code, timed_out, seconds = run_capture(argv, timeout=timeout,
                                                           env=runtime._env,
                                                           limit=runtime.max_output_bytes)
            runtime._released(sandbox_id)
            if code == 255 and MISSING_DESTINATION.search(output[-4000:]):
                # the agent removed a folder the image's copy goes over: made again (empty)
                # on its files, then the verifier as planned
                run_capture(mend_argv(runtime.apptainer, spec, home / "overlay.img",
                                      bind_destinations(argv, entries), info.rootless),
                            timeout=runtime.start_timeout_s, env=runtime._env)
                runtime._released(sandbox_id)
                output, code, timed_out, seconds = run_capture(
                    argv, timeout=timeout, env=runtime._env, limit=runtime.max_output_bytes)
                runtime._released(sandbox_id)
            logs = Path(logs)
            if logs.exists():
                shutil.rmtree(logs)
            _copy_plain(work / "logs", logs)
    finally:
        runtime._launch(sandbox_id, spec, info, record.cpus, record.deadline)
    return ExecResult(output, code, timed_out, False, seconds)
