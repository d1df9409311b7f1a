"""The apptainer runtime against a real Apptainer, as root and as an ordinary user.

Apptainer comes from PATH, else from bin/tmax-setup-apptainer's sid root (made by the
``apptainer`` fixture if missing: about two minutes, once per machine). The ordinary user
(the cluster case) is created here (``tmax-apptainer-test``, no login, home under /tmp);
its cases run as ``python -m tests.apptainer_cases`` under ``setpriv``, with this venv's
packages, on a hard link of the base SIF in a folder it can read. Each case is in
tests/apptainer_cases.py; it asserts what it sees and returns the rest.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest

from sandfleet.runtime.apptainer import ApptainerRuntime

pytest.register_assert_rewrite("tests.apptainer_cases")
from tests import apptainer_cases  # noqa: E402
from tests.integration.test_verifier_forge_attacks import forge_sif  # noqa: E402, F401  (a fixture)
from tests.seal_helpers import apptainer  # noqa: E402, F401  (a fixture)

REPO = Path(__file__).resolve().parents[2]
TEST_USER = "tmax-apptainer-test"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shared(base_sif, apptainer):  # noqa: F811
    """A folder every user can read, holding the base SIF (a hard link, else a copy)."""
    root = Path(tempfile.mkdtemp(prefix="tmax-apptainer-", dir="/tmp"))
    root.chmod(0o755)
    image = root / "base.sif"
    try:
        os.link(base_sif, image)
    except OSError:
        shutil.copyfile(base_sif, image)
    image.chmod(0o644)
    yield root, image
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def user(shared):
    """The ordinary user, created if missing; None when the tests run as one already."""
    if os.geteuid() != 0:
        yield None
        return
    try:
        pwd.getpwnam(TEST_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--home-dir", f"/tmp/{TEST_USER}",
                        "--create-home", "--shell", "/usr/sbin/nologin", TEST_USER],
                       check=True, timeout=60, capture_output=True)
    entry = pwd.getpwnam(TEST_USER)
    yield entry
    # a failed case may leave its instances (its asserts say which): this user is ours
    as_user(entry, [str(REPO / "bin" / "tmax-apptainer"), "instance", "stop", "--all",
                    "--force"], timeout=120)
    as_user(entry, [str(REPO / "bin" / "tmax-apptainer"), "--tmax-release"], timeout=60)
    # (the holder's `sleep` released just now may still be exiting, and on a loaded machine
    # a release's `instance stop` and its watchdog's end can take a while: poll, bounded)
    for _ in range(300):
        ps = subprocess.run(["ps", "-u", str(entry.pw_uid), "-o", "pid=,stat=,args="],
                            capture_output=True, text=True, check=False).stdout
        left = [line for line in ps.splitlines() if line.split()[1][0] != "Z"]  # (reaped later)
        if not left:
            break
        time.sleep(0.2)
    assert not left, f"processes of {TEST_USER} left: {left}"


def user_python() -> tuple[str, dict[str, str]]:
    """A Python the test user can run (this one's interpreter, seeing this venv's
    packages), and the environment it needs. Where this interpreter lives in root's home
    (pyenv), its install is hard-linked once into /var/cache/tmax (no bytes copied)."""
    base = Path(sys.base_prefix).resolve()
    exe = f"python{sys.version_info.major}.{sys.version_info.minor}"
    if all(os.stat(p).st_mode & 0o001 for p in [*reversed(base.parents), base]):
        return str(base / "bin" / exe), {}
    key = hashlib.sha1(str(base).encode()).hexdigest()[:8]
    dest = Path("/var/cache/tmax") / f"python-{base.name}-{key}"
    if not (dest / ".tmax-ready").exists():
        shutil.rmtree(f"{dest}.part", ignore_errors=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", "-al", str(base), f"{dest}.part"], check=True, timeout=300)
        Path(f"{dest}.part", ".tmax-ready").touch()
        shutil.rmtree(dest, ignore_errors=True)
        os.rename(f"{dest}.part", dest)
    return str(dest / "bin" / exe), {"LD_LIBRARY_PATH": str(dest / "lib")}


def as_user(entry, argv: list[str], timeout: float, cwd: str = "/tmp",
            extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**(extra_env or {}), "PATH": os.environ.get("PATH", os.defpath), "HOME": entry.pw_dir,
           "USER": entry.pw_name, "LOGNAME": entry.pw_name,
           "PYTHONPATH": os.pathsep.join([str(REPO), sysconfig.get_paths()["purelib"],
                                          sysconfig.get_paths()["platlib"]])}
    return subprocess.run(["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}",
                           "--init-groups", "--reset-env", "--", "env", *(
                               f"{k}={v}" for k, v in env.items()), *argv],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          stdin=subprocess.DEVNULL, check=False)


def run_case(name: str, who: str, shared, user, tmp_path, image: Path | None = None) -> dict:
    root, base = shared
    image = image or base
    if who == "root":
        if os.geteuid() != 0:
            pytest.fail("the root cases need root", pytrace=False)
        runtime = ApptainerRuntime(tmp_path / "state", owner="t", allow_host_root=True)
        return apptainer_cases.CASES[name](runtime, image)
    if user is None:  # already an ordinary user
        runtime = ApptainerRuntime(tmp_path / "state", owner="t", allow_host_root=True)
        return apptainer_cases.CASES[name](runtime, image)
    state = Path(tempfile.mkdtemp(prefix=f"{name}-state-", dir=root))  # (a case may run twice)
    os.chown(state, user.pw_uid, user.pw_gid)
    python, env = user_python()
    proc = as_user(user, [python, "-m", "tests.apptainer_cases", name, str(image),
                          str(state)], timeout=550, cwd=str(REPO), extra_env=env)
    assert proc.returncode == 0, f"{name} as {TEST_USER} failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


WHO = ["root", "user"]


@pytest.mark.parametrize("who", WHO)
def test_lifecycle(who, shared, user, tmp_path):
    seen = run_case("lifecycle", who, shared, user, tmp_path)
    if who == "root":
        # Apptainer's cgroups: 1 CPU of quota (all CPUs allowed), memory OOM-killed, counted
        assert (seen["cgroup_limits"], seen["rootless"]) == (True, False)
        assert seen["hog"] == "rc=137" and seen["oom"] and seen["oom_kills"] >= 1, seen
    else:
        # no cgroup limits for --fakeroot on cgroup v1: the CPU pinned, memory_mb watched
        # (apptainer_memory): past it the command's every process is killed (its shell too,
        # so no rc line), counted (tests/apptainer_cases.case_memory has more)
        assert (seen["cgroup_limits"], seen["rootless"]) == (False, True)
        assert "," not in seen["cpus"] and "-" not in seen["cpus"], seen
        assert seen["hog_exit"] == 137 and seen["oom"] and seen["oom_kills"] == 1, seen


@pytest.mark.parametrize("who", WHO)
def test_an_ended_instance_leaves_its_overlay_to_the_next_container(who, shared, user,
                                                                    tmp_path):
    seen = run_case("overlay_released", who, shared, user, tmp_path)
    assert seen.pop("held_while_running") is True  # (what the check looks for is real)
    assert seen.pop("verify") == seen.pop("after") == "/root/data: OK\n"
    assert seen == {f"held_after_end_{n}": [] for n in range(3)}


def test_memory_limit_of_an_ordinary_users_instance(shared, user, tmp_path):
    """Rootless on cgroup v1, where Apptainer applies no --memory: the runtime's watcher
    kills what goes past memory_mb (tests/apptainer_cases.case_memory)."""
    seen = run_case("memory", "user", shared, user, tmp_path)
    assert (seen["cgroup_limits"], seen["rootless"]) == (False, True), seen
    # the sums seen at the kills (MiB, rounded down): past the limit (256 MiB); the one
    # process short of the 768 MiB it asked for (RLIMIT_DATA, or the kill, stopped it)
    assert 256 <= seen["grow_peak_mb"] < 768 and seen["group_peak_mb"] >= 256, seen
    assert seen["oom_kills"] == 3, seen


@pytest.mark.parametrize("who", WHO)
def test_the_allowlist_network_reaches_its_hosts_and_nothing_else(who, shared, user, tmp_path):
    seen = run_case("allowlist", who, shared, user, tmp_path)
    assert seen["allowed"] == "upstream", seen
    assert seen["refused"].startswith("FAILED") and "403" in seen["refused"], seen
    assert seen["direct"].startswith("FAILED") and "unreachable" in seen["direct"], seen
    assert seen["apt"].startswith("tree v"), seen
    assert seen["stats"]["allowed"] > 3 and seen["stats"]["refused"] == 1, seen


def test_an_ordinary_users_root_inside_cannot_write_the_hosts_settings(shared, user, tmp_path):
    """Rootless, root inside is the user (one id mapped): the host's /proc/sys and every
    cgroup file refuse it. As root these writes go through (tests/integration/test_seal_inside.py's
    strict xfails; the runtime refuses a root worker unless apptainer_allow_root)."""
    seen = run_case("host_reach", "user", shared, user, tmp_path)
    uid = str(user.pw_uid)
    assert seen.pop("uid_map") == ["0", uid, "1"]
    assert seen == dict.fromkeys(apptainer_cases.HOST_REACH, "refused")


@pytest.mark.parametrize("who", WHO)
def test_persistent_shell(who, shared, user, tmp_path):
    run_case("shell", who, shared, user, tmp_path)


@pytest.mark.parametrize("who", WHO)
def test_lifetime_kill_and_bad_image(who, shared, user, tmp_path):
    run_case("lifetime_and_kill", who, shared, user, tmp_path)


@pytest.mark.parametrize("who", WHO)
def test_worker_death_then_reap(who, shared, user, tmp_path):
    run_case("worker_death", who, shared, user, tmp_path)


@pytest.mark.parametrize("who", WHO)
def test_the_verifier_gets_its_own_reward_under_every_attack(who, shared, user, tmp_path):
    """The seal attacks of tests/integration/test_seal_rollout.py (there through an apptainer fleet as
    root), at the runtime, as root and as an ordinary user: each forged reward loses to the
    verifier's (tests/apptainer_cases.SEAL_ATTACKS)."""
    got = run_case("verifier_seal", who, shared, user, tmp_path)
    assert got == dict.fromkeys(apptainer_cases.SEAL_ATTACKS, "0.25")


@pytest.fixture(scope="module")
def shared_layered(layered_base, shared) -> Path:
    """conftest's ``layered_base`` where every user can read it: its task layer copied
    into the shared folder, over the shared base SIF."""
    from sandfleet import layers

    task = shared[0] / "task.sqfs"
    shutil.copyfile(layers.read(layered_base)[0].path, task)
    task.chmod(0o644)
    layers.write(shared[0] / "task.layers", [task, shared[1]])
    (shared[0] / "task.layers").chmod(0o644)
    return shared[0] / "task.layers"


@pytest.mark.parametrize("who", WHO)
def test_the_seal_holds_on_a_layered_image(who, shared, user, tmp_path, shared_layered):
    """The same attacks on a layered image (a task layer over the base, as builds store
    task images), as root and as an ordinary user (read-only squashfs overlays mounted
    with squashfuse)."""
    got = run_case("verifier_seal", who, shared, user, tmp_path, image=shared_layered)
    assert got == dict.fromkeys(apptainer_cases.SEAL_ATTACKS, "0.25")


PYTEST_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "py.py")


@pytest.fixture(scope="module")
def forge_image(forge_sif, shared, tmp_path_factory) -> Path:  # noqa: F811
    """tests/integration/test_verifier_forge_attacks.py's image plus this venv's pytest (pure Python,
    the image's 3.11) in the image's dist-packages, where every user can read it."""
    from sandfleet.runtime import sif

    root = tmp_path_factory.mktemp("forge-pytest") / "root"
    sif.extract(forge_sif, root)
    site = Path(pytest.__file__).resolve().parents[1]
    dest = root / "usr" / "lib" / "python3" / "dist-packages"
    for name in PYTEST_PACKAGES:
        (shutil.copytree if (site / name).is_dir() else shutil.copyfile)(site / name,
                                                                         dest / name)
    image = sif.pack(root, shared[0] / "forge.sif")
    image.chmod(0o644)
    return image


@pytest.mark.parametrize("who", WHO)
def test_the_verifier_is_not_forged_by_issue_33s_attacks(who, shared, user, forge_image,
                                                          tmp_path):
    """The uv installer's env file defining ``uvx() { return 0; }``, ``python3 -m pytest``
    (and unittest) with the agent's module of that name in the workdir, an agent's program
    in the image's top-level /venv, an apt hook: each forged reward 1 on Apptainer before
    the verifier applied the plan's stand-in, PYTHONPATH guard and PATH folders; now each
    gets the verifier's own (tests/apptainer_cases.forge_attacks), and tests that import
    the agent's module from the workdir still pass."""
    got = run_case("verifier_forges", who, shared, user, tmp_path, image=forge_image)
    want = {a: expected for a, (*_, expected) in apptainer_cases.forge_attacks().items()}
    assert got == {**want, "legitimate-import-from-workdir": "1"}
