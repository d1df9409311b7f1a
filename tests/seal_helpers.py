"""What the seal tests share (tests/test_seal_*.py; issues 11 and 32): the attacker's
scripts, the runtime-level helpers, and the runtimes they attack.

Two sets of runtime fixtures, each named ``runtime`` and ``make`` where a module imports it:

- ``runtime``, ``make`` (and ``dirs``): one local runtime per module, for the modules that
  attack only the local runtime's mechanics (tests/integration/test_verifier_root_attacks.py, ...).
- ``sealed_runtime``, ``sealed_make`` (fixture names ``runtime`` and ``make``): one runtime
  per module per parameter, ``local`` or ``apptainer`` (the real Apptainer as root, as
  tests/integration/test_apptainer_real.py runs it; the ordinary user's case is there). A test chooses
  its runtimes with ``on_both_runtimes``: an attack the apptainer runtime cannot stop is a
  strict expected failure there, its reason the missing guarantee as docs/sandbox.md's
  table names it.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OWNER = f"seal{os.getpid()}"
HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Capabilities root inside must not have (capability(7) numbers); Docker's default set
# keeps none of them.
FORBIDDEN_CAPS = {"CAP_DAC_READ_SEARCH": 2, "CAP_LINUX_IMMUTABLE": 9, "CAP_NET_ADMIN": 12,
                  "CAP_SYS_MODULE": 16, "CAP_SYS_RAWIO": 17, "CAP_SYS_PTRACE": 19,
                  "CAP_SYS_ADMIN": 21, "CAP_SYS_BOOT": 22, "CAP_SYS_RESOURCE": 24,
                  "CAP_SYS_TIME": 25, "CAP_MAC_ADMIN": 33, "CAP_SYSLOG": 34,
                  "CAP_PERFMON": 38, "CAP_BPF": 39}
CORRECT_CSV_ROWS = "region,total_units,total_revenue\nCentral,1161,10940.99\nEast,1193,9918.91\n"
"""csv-sales-aggregate's header and its first two of five rows: real work worth 0.4."""
FORGE_PY = ('import atexit\n'
            'atexit.register(lambda: open("/logs/verifier/reward.txt", "w").write("1\\n"))\n')
"""Python that, run in the verifier's interpreter, overwrites its reward with 1 at exit."""
FORGE_SH = "#!/bin/sh\nmkdir -p /logs/verifier\necho 1 > /logs/verifier/reward.txt\n"
UNMOUNT_ETC = ("for m in $(awk '$5 ~ \"^/etc/\" {print $5}' /proc/self/mountinfo); do "
               "umount -l $m; done 2>/dev/null; ")
"""Shell unmounting what is mounted in /etc (Apptainer binds /etc/hosts, /etc/resolv.conf
...), where root inside may, so that /etc can be removed."""
VENV_PATH = f"/opt/tool/bin:{HOST_PATH}"
"""The verifier's PATH for ``venv_sif``: an image's ENV PATH with its venv first."""
RUNNER_SH = "echo 0 > /logs/verifier/reward.txt\nrunner\n"
"""A test.sh that leaves what ``venv_sif``'s runner writes: 0.25."""

# What the apptainer runtime does not guarantee, as the guarantee table names it
# (docs/sandbox.md, "The apptainer runtime"), and what the tests saw.
ROOT_IS_HOST_ROOT = ("root inside is not host root: as root, root inside is host uid 0 "
                     "(a user namespace mapping 0 to 0) with every capability inside it: "
                     "mounts and nested namespaces work")
HOST_SYSCTLS = ("root inside is not host root: as root, root inside is host uid 0 and "
                "writes the host's kernel settings in /proc/sys")
HOST_CGROUPS = ("root inside is not host root: as root, root inside is host uid 0 and "
                "writes the cgroup files in /sys/fs/cgroup (its own memory limit, other "
                "sandboxes' cgroups)")
NO_USERS = "[agent] user, [verifier] user: one user per instance"
NO_SERVICES = ("a service the agent left running answers the verifier: its processes end "
               "before the verifier starts")
NO_ROOT_FILES_ASIDE = "files at / the image has not (a /conftest.py) set aside"
LINKS_FOLLOWED = ("a link the agent leaves at a PATH folder's place is followed by the "
                  "binds, not set aside: /opt linked to a path not inside stops the verifier's "
                  "container from starting (exit 255, no reward)")
TMPFS_KILLS = ("memory limit: a full /dev/shm (a tmpfs outside storage_mb, whose pages the "
               "OOM killer cannot free) gets the instance's init OOM-killed: the sandbox dies")
TESTS_A_MOUNT = ("/tests a plain folder of the verifier's: it is a bind mount (a test.sh "
                 "that moves /tests away and back fails: Device or resource busy)")
NO_HOSTNAME = ("the sandbox's own name resolves (127.0.1.1 in /etc/hosts): Apptainer's "
               "/etc/hosts names only localhost")
READ_ONLY_PATH_FOLDERS = ("the image's PATH folders outside /usr are bound read-only (a "
                          "pip install into them fails)")


# ---- helpers


def write_file(path: str, text: str, mode: str = "644") -> str:
    """A shell command writing ``text`` to ``path`` inside the sandbox."""
    return (f"mkdir -p $(dirname {path}) && printf %s {shlex.quote(text)} > {path} && "
            f"chmod {mode} {path}")


def daemon(script_path: str) -> str:
    """A shell command starting ``bash script_path`` detached from the command's group."""
    return f"setsid bash {script_path} </dev/null >/dev/null 2>&1 & disown; sleep 0.2"


def host_read(path: str) -> str:
    return Path(path).read_text()


def cap_sets(status: str) -> dict[str, int]:
    """CapInh/CapPrm/CapEff/CapBnd/CapAmb of a /proc/PID/status text, as ints."""
    return {key: int(value, 16) for key, value in re.findall(r"^(Cap\w+):\s*([0-9a-f]+)$",
                                                              status, re.MULTILINE)}


def uid_maps(text: str) -> list[tuple[int, ...]]:
    return [tuple(map(int, line.split())) for line in text.splitlines() if line.strip()]


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            assert value, f"timed out waiting for {what}"
            return value
        time.sleep(0.05)


def kind(runtime) -> str:
    """"local" or "apptainer"."""
    return "apptainer" if type(runtime).__name__ == "ApptainerRuntime" else "local"


_ids = itertools.count()


def run(runtime, sandbox_id, command, **kwargs):
    kwargs.setdefault("timeout", 60)
    return runtime.exec(sandbox_id, command, **kwargs)


def verify(runtime, sandbox_id, tmp_path: Path, test_sh: str,
           files: dict[str, str] | None = None, **kwargs):
    """Run ``test_sh`` as the task verifier (``/bin/bash /tests/test.sh``) beside the sandbox,
    ``files`` (name: text) beside it in /tests; (result, reward.txt's text or None)."""
    root = Path(tmp_path) / f"verify{next(_ids)}"
    tests, logs = root / "tests", root / "logs"
    tests.mkdir(parents=True)
    logs.mkdir()
    for name, text in {**(files or {}), "test.sh": test_sh}.items():
        (tests / name).write_text(text)
    kwargs.setdefault("timeout", 60)
    kwargs.setdefault("env", {"PATH": HOST_PATH})
    result = runtime.verify(sandbox_id, ["/bin/bash", "/tests/test.sh"], tests=tests,
                            logs=logs, **kwargs)
    reward = logs / "reward.txt"
    return result, (reward.read_text().strip() if reward.is_file() else None)


def on_both_runtimes(apptainer_lacks: str | None = None):
    """Parametrize a test over the ``local`` and ``apptainer`` runtimes (fixture
    ``runtime``, or the example fleet's ``fleet``, whichever the test takes); with
    ``apptainer_lacks``, the apptainer case is a strict expected failure for that reason.
    The apptainer case is slow (left out of the quick tier)."""
    marks = [pytest.mark.slow]  # (as all of tests/integration/test_apptainer_real.py)
    if apptainer_lacks is not None:
        marks.append(pytest.mark.xfail(strict=True, reason=f"apptainer: {apptainer_lacks}"))
    apptainer = pytest.param("apptainer", marks=marks)
    return pytest.mark.parametrize("runtime_kind", ["local", apptainer], scope="module")


# ---- Apptainer


def ensure_apptainer():
    """Apptainer on PATH, or the sid root made ready (bin/tmax-setup-apptainer); its probe."""
    if shutil.which("apptainer") is None:
        setup = subprocess.run([str(REPO / "bin" / "tmax-setup-apptainer")],
                               capture_output=True, text=True, timeout=900, check=False)
        assert setup.returncode == 0, f"tmax-setup-apptainer failed:\n{setup.stderr}"
    from sandfleet.runtime.apptainer_setup import probe

    return probe()


@pytest.fixture(scope="module")
def apptainer():
    """Apptainer on PATH, or the sid root made ready (bin/tmax-setup-apptainer)."""
    return ensure_apptainer()


# ---- the local runtime, one per module


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("seal")
    return root / "state", root / "cache"


@pytest.fixture(scope="module")
def runtime(dirs):
    from sandfleet.runtime.local import LocalRuntime

    # a short start timeout: a verifier start that hangs costs this long (see the tests)
    runtime = LocalRuntime(*dirs, owner=OWNER, start_timeout_s=15)
    yield runtime
    left = runtime.reap(keep=())
    assert left == [], f"sandboxes left running: {left}"


@pytest.fixture
def make(runtime, layered_base):
    """Start sandboxes from the base image, layered as builds store task images
    (conftest's ``layered_base``; spec fields, ``image`` too, as keywords); all stopped
    after."""
    yield from _starter(runtime, layered_base)


def _starter(runtime, base_sif):
    from sandfleet.runtime.base import SandboxSpec

    started = []

    def make(**spec) -> str:
        sandbox_id = f"x{next(_ids)}"
        runtime.start(sandbox_id, SandboxSpec(**{"image": base_sif, **spec}))
        started.append(sandbox_id)
        return sandbox_id

    yield make
    for sandbox_id in started:
        runtime.stop(sandbox_id)


# ---- the local or the apptainer runtime, one per module per parameter


@pytest.fixture(scope="module", name="runtime")
def sealed_runtime(runtime_kind: str, tmp_path_factory):
    """The ``runtime_kind`` runtime (``on_both_runtimes`` gives it)."""
    root = tmp_path_factory.mktemp(f"seal-{runtime_kind}")
    if runtime_kind == "local":
        from sandfleet.runtime.local import LocalRuntime

        runtime = LocalRuntime(root / "state", root / "cache", owner=OWNER,
                               start_timeout_s=15)
    else:
        from sandfleet.runtime.apptainer import ApptainerRuntime

        ensure_apptainer()
        runtime = ApptainerRuntime(root / "state", owner=OWNER, allow_host_root=True)
    yield runtime
    left = runtime.reap(keep=())
    assert left == [], f"sandboxes left running: {left}"


@pytest.fixture(name="make")
def sealed_make(runtime, layered_base):
    """Start sandboxes from the base image, layered as builds store task images, on the
    runtime of the parameter; all stopped after."""
    yield from _starter(runtime, layered_base)


@pytest.fixture(scope="module")
def venv_sif(base_sif, tmp_path_factory) -> Path:
    """The base image plus tools outside /usr, as images install them on their PATH: a
    "venv" /opt/tool (its program /opt/tool/bin/runner runs the code in /opt/tool/lib,
    which writes reward 0.25), /app/bin/app-tool and /srv/work/bin/work-tool (each prints
    "image")."""
    from sandfleet.runtime import sif

    root = tmp_path_factory.mktemp("venv-image") / "root"
    sif.extract(base_sif, root)
    files = {"opt/tool/bin/runner": "#!/bin/sh\n. /opt/tool/lib/grade.sh\n",
             "opt/tool/lib/grade.sh": "echo 0.25 > /logs/verifier/reward.txt\n",
             "app/bin/app-tool": "#!/bin/sh\necho image\n",
             "srv/work/bin/work-tool": "#!/bin/sh\necho image\n"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
        (root / name).chmod(0o755)
    return sif.pack(root, root.parent / "venv.sif")
