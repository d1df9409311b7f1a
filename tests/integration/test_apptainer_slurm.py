"""The cluster case end to end: an ordinary user runs a fleet with ``provider: slurm`` and
``runtime: apptainer`` on the local Slurm cluster (its workers that user's Slurm jobs, its
sandboxes rootless Apptainer instances), and ``tmax eval`` (as that user) of shipped
example tasks through it: the oracle scores 1 and nop 0, with no infrastructure failure
and no verifier error. Then the fleet goes down and nothing of that user is left: no job,
no instance, no sandbox folder, no mount, no process.

The user (``tmax-slurm-test``, not tests/integration/test_apptainer_real.py's, whose module may run at
the same time on another pytest-xdist worker) and the store (the example images
hard-linked into a folder it can read) are made here; the cluster is the session's
``local_slurm``.
``TMAX_APPTAINER_SLURM_TASKS=all`` (or a comma list) evaluates other tasks than the four
quick ones, e.g. every shipped example by hand.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import EXAMPLES
from tests.integration.test_apptainer_real import REPO, as_user, user_python

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

TEST_USER = "tmax-slurm-test"
APPTAINER = str(REPO / "bin" / "tmax-apptainer")
SANDFLEET = ["-m", "sandfleet.cli"]
TMAX = ["-c", "from tmax.cli import main; main(prog_name='tmax')"]
QUICK_TASKS = ("hello-world-file", "count-log-lines", "sha256-digest", "sqlite-count-rows")


def chosen_tasks() -> list[str]:
    wanted = os.environ.get("TMAX_APPTAINER_SLURM_TASKS", "")
    if wanted == "all":
        return sorted(p.name for p in EXAMPLES.iterdir() if (p / "task.toml").exists())
    return [t for t in wanted.split(",") if t] or list(QUICK_TASKS)


@pytest.fixture(scope="module")
def user():
    """The ordinary user, created if missing (no login, home under /tmp)."""
    if os.geteuid() != 0:
        pytest.fail("this module makes an ordinary user: it needs root", pytrace=False)
    try:
        pwd.getpwnam(TEST_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--home-dir", f"/tmp/{TEST_USER}",
                        "--create-home", "--shell", "/usr/sbin/nologin", TEST_USER],
                       check=True, timeout=60, capture_output=True)
    return pwd.getpwnam(TEST_USER)


@pytest.fixture(scope="module")
def home(user, example_store):
    """A folder of the user's: the example images (hard links, the manifest its own copy),
    and room for the fleet's state, work and cache folders and the eval runs."""
    root = Path(tempfile.mkdtemp(prefix="tmax-slurm-", dir="/tmp"))
    root.chmod(0o755)
    store = root / "store"
    for sub in ("sif", "bases", "logs", "locks", "tmp"):
        (store / sub).mkdir(parents=True)
    for sub in ("sif", "bases"):
        for image in (example_store.root / sub).iterdir():
            os.link(image, store / sub / image.name)
    shutil.copyfile(example_store.manifest_path, store / "manifest.json")
    for path in [root, *root.rglob("*")]:
        if not path.is_file() or path.name == "manifest.json":
            os.chown(path, user.pw_uid, user.pw_gid)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def run_as(user, local_slurm, module: list[str], *args: str, timeout: float = 120,
           check: bool = True) -> subprocess.CompletedProcess:
    python, env = user_python()
    proc = as_user(user, [python, *module, *args], timeout=timeout, cwd=str(REPO),
                   extra_env={**env, "SLURM_CONF": str(local_slurm.conf)})
    if check:
        assert proc.returncode == 0, f"{module} {args} as {TEST_USER} failed " \
                                     f"({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def user_jobs(user, local_slurm) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-u", user.pw_name, "-o", "%i"], env=local_slurm.env,
                         capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.split()


def user_processes(user) -> list[str]:
    ps = subprocess.run(["ps", "-u", str(user.pw_uid), "-o", "pid=,stat=,args="],
                        capture_output=True, text=True, check=False).stdout
    return [line for line in ps.splitlines() if line.split()[1][0] != "Z"]


def wait_until(predicate, timeout: float, what: str, show=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{show()}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def fleet(user, local_slurm, home):
    """The user's fleet on the cluster; down at the end, then checked: nothing left."""
    assert not user_jobs(user, local_slurm), "jobs of the test user before the test"
    python, env = user_python()
    state, work = home / "state", home / "work"
    config = {
        "provider": "slurm", "runtime": "apptainer", "min_nodes": 0, "max_nodes": 2,
        "cpus_per_node": 2, "memory_mb_per_node": 2048, "idle_s": 120,
        "heartbeat_s": 2.0, "lost_after_s": 30.0, "lease_ttl_s": 120,
        "acquire_wait_s": 300, "worker_grace_s": 30, "scale_interval_s": 0.5,
        "work_dir": str(work), "cache_dir": str(home / "cache"),
        "slurm": {"time_min": 20, "poll_min_s": 0.5, "poll_max_s": 2.0, "drain_before_s": 0,
                  "python": python,
                  "setup": [f"export {k}={v}" for k, v in env.items()]},
    }
    (home / "fleet.yaml").write_text(yaml.safe_dump(config))
    os.chown(home / "fleet.yaml", user.pw_uid, user.pw_gid)
    jobs: set[str] = set()

    def logs() -> str:
        return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted((state / "logs").glob("*")) if p.is_file())

    try:
        run_as(user, local_slurm, SANDFLEET, "up", "--config", str(home / "fleet.yaml"),
               "--state-dir", str(state))
        yield {"state": state, "home": home, "jobs": jobs, "logs": logs}
    finally:
        down = run_as(user, local_slurm, SANDFLEET, "down", "--state-dir", str(state),
                      timeout=240, check=False)
        # every job it ever had is gone from the queue (cancelled, then ended)
        wait_until(lambda: not user_jobs(user, local_slurm), 120, "the user's jobs to end",
                   logs)
        gc = run_as(user, local_slurm, SANDFLEET, "gc", "--state-dir", str(state), check=False)
        instances = as_user(user, [APPTAINER, "instance", "list", "--json"], timeout=120)
        sandboxes = sorted(str(p) for p in work.glob("*/*/runtime/sandboxes/*"))
        worker_dirs = sorted(str(p) for p in work.glob("*/*"))
        mounts = [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
                  if str(home) in line]
        # the sid root's holder (bin/tmax-apptainer's stand-in for a system apptainer: a
        # `sleep infinity` keeping this user's namespace) is the only process left: end it
        holder_mounts = []
        holder = Path(f"/tmp/tmax-apptainer-{user.pw_uid}")
        for file in holder.glob("holder-*"):
            pid = file.read_text().split()[0]
            try:
                holder_mounts = [line for line in
                                 Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
                                 if str(home) in line or "fuse" in line.split(" - ")[-1]]
            except (OSError, ValueError):
                pass
        as_user(user, [APPTAINER, "--tmax-release"], timeout=60)
        wait_until(lambda: not user_processes(user), 60, f"{TEST_USER}'s processes to end",
                   lambda: "\n".join(user_processes(user)))
        assert down.returncode == 0, f"sandfleet down:\n{down.stdout}\n{down.stderr}"
        assert gc.returncode == 0, f"sandfleet gc:\n{gc.stdout}\n{gc.stderr}"
        assert jobs, "the fleet ran no Slurm job"
        assert instances.returncode == 0, instances.stderr
        assert json.loads(instances.stdout or "{}").get("instances") in (None, []), \
            instances.stdout
        assert not sandboxes, f"sandboxes left: {sandboxes}"
        assert not worker_dirs, f"worker folders left: {worker_dirs}"
        assert not mounts and not holder_mounts, f"mounts left: {mounts + holder_mounts}"


def fleet_status(user, local_slurm, fleet) -> dict:
    """The fleet's status; its worker jobs (Slurm jobs of the user, as squeue shows them)
    recorded for the teardown's check."""
    status = json.loads(run_as(user, local_slurm, SANDFLEET, "status", "--state-dir",
                               str(fleet["state"]), "-o", "json").stdout)
    ids = {j["job_id"] for j in status["jobs"]}
    assert ids and ids <= set(user_jobs(user, local_slurm)), \
        (ids, user_jobs(user, local_slurm))
    fleet["jobs"] |= ids
    return status


@pytest.mark.parametrize("policy,reward", [("oracle", 1.0), ("nop", 0.0)])
def test_examples_score_through_an_apptainer_fleet_of_slurm_jobs_of_an_ordinary_user(
        policy, reward, user, local_slurm, fleet):
    tasks = chosen_tasks()
    out = fleet["home"] / f"eval-{policy}"
    args = [a for t in tasks for a in ("--tasks", str(EXAMPLES / t))]
    proc = run_as(user, local_slurm, TMAX, "eval", *args, "--policy", policy,
                  "--fleet", str(fleet["state"]), "--store", str(fleet["home"] / "store"),
                  "--out", str(out), "--concurrency", "4", "--strict", "--no-progress",
                  timeout=1800, check=False)
    status = fleet_status(user, local_slurm, fleet)
    assert proc.returncode == 0, f"tmax eval failed:\n{proc.stdout}\n{proc.stderr}\n" \
                                 f"{fleet['logs']()}"
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    wrong = {r["task"]: {k: r.get(k) for k in ("reward", "infra_failure", "verifier_error",
                                                 "internal_error", "attempt")}
             for r in records if r["reward"] != reward or r.get("infra_failure")}
    assert not wrong, f"{wrong}\n{fleet['logs']()}"
    assert sorted(r["task"] for r in records) == sorted(tasks)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mean_reward"] == reward, summary
    assert summary["infra_failure_rate"] == 0.0 and summary["verifier_errors"] == 0, summary
    # and none the fleet saw (a lease lost after its verify is one, though the episode scored)
    assert status["failures"] == {}, (status["failures"], status["recent_failures"])
    # and no worker stumbled on its way (two first apptainer calls of one user at once hung
    # one of them until its timeout: "instance list failed ... timed out")
    troubles = [line for path in sorted((fleet["state"] / "logs").glob("slurm-*.out"))
                for line in path.read_text(errors="replace").splitlines()
                if " WARNING " in line or " ERROR " in line]
    assert not troubles, troubles


def test_the_wrappers_holder_does_not_keep_its_start_lock(user):
    """bin/tmax-apptainer's first call of a user starts the holder under a lock; the
    holder inherited it and kept it for good, so a second first call (two workers of one
    user starting on a node at once) waited on it until its timeout. The first call here
    has a Debian user's PATH (no sbin: pivot_root was not found)."""
    if shutil.which("apptainer") is not None:
        pytest.skip("a real apptainer on PATH: the wrapper execs it, no holder")
    first = as_user(user, ["env", "PATH=/usr/local/bin:/usr/bin:/bin", APPTAINER, "instance",
                           "list"], timeout=120)
    assert first.returncode == 0, first.stderr
    try:
        free = as_user(user, ["flock", "--nonblock", f"/tmp/tmax-apptainer-{user.pw_uid}/lock",
                              "true"], timeout=30)
        assert free.returncode == 0, "the holder holds the start lock"
    finally:
        as_user(user, [APPTAINER, "--tmax-release"], timeout=60)
