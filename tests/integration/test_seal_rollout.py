"""Forged rewards and episodes turned into infrastructure failures, through the fleet and the
rollout path as training and evaluation use them (``tmax.rollout.run.rollout`` with a
scripted attacker), on a fleet of the local and of the apptainer runtime (issues 11 and 32).
Each attack's expected reward is what the agent's real work earns. An attack the apptainer
runtime (as root) does not stop is a strict expected failure there, naming the guarantee it
lacks (tests/seal_helpers.py).
"""

from __future__ import annotations

import asyncio
import shutil
import textwrap
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES
from tests.seal_helpers import (
    CORRECT_CSV_ROWS,
    FORGE_PY,
    FORGE_SH,
    NO_SERVICES,
    TMPFS_KILLS,
    UNMOUNT_ETC,
    daemon,
    ensure_apptainer,
    on_both_runtimes,
    write_file,
)

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]
HELLO = EXAMPLES / "hello-world-file"
CSV = EXAMPLES / "csv-sales-aggregate"


@pytest.fixture(scope="module")
def fleet(runtime_kind: str, request, tmp_path_factory):
    """The session's local example fleet, or a fleet of one apptainer worker (as
    tests/integration/test_apptainer_fleet.py runs it) for this module."""
    if runtime_kind == "local":
        yield request.getfixturevalue("example_fleet")
        return
    from tests.fleet_harness import Fleet

    ensure_apptainer()
    root = tmp_path_factory.mktemp("seal-apptainer-fleet")
    with Fleet(root, root / "cache", runtime="apptainer", apptainer_allow_root=True, min_nodes=1, cpus_per_node=8,
               memory_mb_per_node=16384, heartbeat_s=2.0, lost_after_s=30.0,
               lease_ttl_s=120, acquire_wait_s=120).running() as apptainer_fleet:
        yield apptainer_fleet


def roll(task_dir: Path, commands: list[str], example_store, fleet, *,
         task_id: str | None = None):
    """One rollout of ``task_dir`` through ``fleet`` by a policy that runs
    ``commands`` and then submits; its trajectory."""
    from tmax.agent.config import load_agent_config
    from tmax.agent.policies.simple import ScriptedPolicy
    from tmax.fleet import open_fleet
    from tmax.rollout.run import TaskImages, rollout
    from tmax.tasks import load_task

    task = load_task(task_dir, task_id=task_id)

    async def go():
        async with open_fleet(fleet.state) as client:
            return await rollout(task, ScriptedPolicy(commands, name="attacker"), client,
                                 TaskImages(example_store.root), load_agent_config())

    return asyncio.run(go())


def outputs(traj) -> str:
    return "\n".join(str(m.get("content") or "") for m in traj.messages
                     if m.get("role") in ("tool", "user"))


def scored(traj) -> tuple:
    return (traj.reward, traj.infra_failure, traj.verifier_error, traj.end_reason)


def copy_task(src: Path, tmp_path: Path, *, test_sh: str, verifier: str = "") -> Path:
    """A copy of example task ``src`` (same folder name, so the same built image) with its
    own tests/test.sh and extra [verifier] keys."""
    dest = tmp_path / src.name
    shutil.copytree(src, dest)
    (dest / "tests" / "test.sh").write_text(test_sh)
    if verifier:
        toml = (dest / "task.toml").read_text()
        (dest / "task.toml").write_text(toml.replace("[verifier]\n", f"[verifier]\n{verifier}\n"))
    return dest


WATCHER = textwrap.dedent("""\
    while :; do
      for d in /proc/[0-9]*; do
        p=${d#/proc/}
        c=$(tr '\\0' ' ' < $d/cmdline 2>/dev/null) || continue
        case "$c" in
          *test.sh*|*check.py*)
            echo 1 > $d/root/logs/verifier/reward.txt
            kill -STOP $p ;;
        esac
      done
    done
    """)


ATTACKS = {
    # (a) pre-created, read-only and (where the kernel lets it) immutable
    "pre-created": (HELLO, [
        ("mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt && "
         "echo '{\"reward\": 1}' > /logs/verifier/reward.json && "
         "chattr +i /logs/verifier/reward.txt /logs/verifier/reward.json /logs/verifier; "
         "chmod -R a-w /logs; true")], 0.0),
    # (b) a background loop keeps writing it (atomically: a reader never sees it empty)
    "rewriting-loop": (HELLO, [
        write_file("/opt/loop.sh", "while :; do mkdir -p /logs/verifier; echo 1 > "
                   "/logs/verifier/.r && mv -f /logs/verifier/.r /logs/verifier/reward.txt; "
                   "done\n") + " && " + daemon("/opt/loop.sh")], 0.0),
    # (c) a read-only folder holding reward 1 bind-mounted over /logs/verifier
    "bind-mount": (HELLO, [
        ("mkdir -p /opt/fake /logs/verifier && echo 1 > /opt/fake/reward.txt && "
         "if mount --bind /opt/fake /logs/verifier && mount -o remount,ro,bind /logs/verifier;"
         " then echo BIND-MOUNTED; else echo BIND-REFUSED; fi")], 0.0),
    # (d) the verifier's interpreter replaced, over real work worth 0.4
    "python3-replaced": (CSV, [
        write_file("/app/summary.csv", CORRECT_CSV_ROWS),
        write_file("/opt/forge", FORGE_SH, "755") + " && for p in /usr/bin/python3 "
        "/usr/bin/python3.11 /usr/local/bin/python3; do rm -f $p; cp /opt/forge $p; done"],
        0.4),
    # (d) the verifier's shell replaced
    "bash-replaced": (HELLO, [
        write_file("/opt/forge", FORGE_SH, "755") + " && cp /opt/forge /usr/bin/bash.new && "
        "mv -f /usr/bin/bash.new /usr/bin/bash"], 0.0),
    # (e) a watcher that waits for test.sh/check.py to forge through /proc/PID/root and stop
    "proc-watcher": (HELLO, [write_file("/opt/watch.sh", WATCHER) + " && "
                             + daemon("/opt/watch.sh")], 0.0),
    # (f) the loader's preload list and python's site customisation (the image's, in /etc)
    "etc-preload-sitecustomize": (CSV, [
        write_file("/app/summary.csv", CORRECT_CSV_ROWS),
        "echo /opt/agent-preload.so > /etc/ld.so.preload && "
        + write_file("/etc/python3.11/sitecustomize.py", FORGE_PY) + " && "
        + write_file("/usr/lib/python3/dist-packages/zz-forge.pth",
                     "import atexit; atexit.register(lambda: open('/logs/verifier/reward.txt',"
                     " 'w').write('1'))\n")], 0.4),
}


@on_both_runtimes()
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_forged_reward_gives_the_verifiers_reward(attack, example_store, fleet,
                                                   runtime_kind):
    task_dir, commands, expected = ATTACKS[attack]
    traj = roll(task_dir, commands, example_store, fleet)
    assert scored(traj) == (expected, None, None, "submitted"), \
        (scored(traj), traj.verifier_output[-1500:], outputs(traj)[-1500:])
    if attack == "bind-mount" and runtime_kind == "local":  # (Apptainer: mounts work inside,
        # see test_seal_inside.py; the verifier's container has its own /logs/verifier)
        assert "BIND-REFUSED" in outputs(traj) and "BIND-MOUNTED" not in outputs(traj)
    assert "ld.so.preload" not in traj.verifier_output


@on_both_runtimes()
def test_a_symlinked_etc_does_not_forge_the_reward_through_the_rollout(example_store,
                                                                        fleet, runtime_kind):
    """On csv-sales-aggregate, 2 of 5 rows right (0.4) plus ``cp -a /etc /etc2``, a
    sitecustomize in /etc2/python3.11 with an atexit hook writing reward 1, ``rm -rf /etc;
    ln -s /etc2 /etc`` scores the 0.4 (1.0 on the local runtime once: see
    test_a_symlinked_etc_does_not_give_the_verifier_the_agents_interpreter_config)."""
    commands = [write_file("/app/summary.csv", CORRECT_CSV_ROWS),
                "cp -a /etc /etc2 2>/dev/null; " + write_file("/etc2/python3.11/sitecustomize.py",
                                                    FORGE_PY)
                + " && " + UNMOUNT_ETC
                + "(rm -rf /etc || mv /etc /etc.old) && ln -s /etc2 /etc && echo swapped"]
    traj = roll(CSV, commands, example_store, fleet)
    # (on Apptainer as root /etc cannot go, only most of it: see test_seal_verifier.py)
    assert "swapped" in outputs(traj) or runtime_kind == "apptainer"
    assert scored(traj) == (0.4, None, None, "submitted"), traj.verifier_output[-1500:]


@on_both_runtimes()
@pytest.mark.parametrize("opt_in,reward", [(True, 1.0), (False, 0.0)],
                         ids=["agent_system", "image_system"])
def test_a_task_opting_in_to_agent_system_sees_the_agents_usr(opt_in, reward, tmp_path,
                                                               example_store, fleet):
    """The agent's program named as one of the image's (``basename``, before the image's
    /usr/bin/basename on PATH) grades only a task that opts in (a program the image has
    not, the local verifier sees without: tests/integration/test_verifier_additions.py)."""
    test_sh = ("#!/bin/bash\nmkdir -p /logs/verifier\necho 0 > /logs/verifier/reward.txt\n"
               "basename /x/0 > /tmp/r && mv /tmp/r /logs/verifier/reward.txt\n")
    task = copy_task(HELLO, tmp_path, test_sh=test_sh,
                     verifier="agent_system = true" if opt_in else "")
    traj = roll(task, [write_file("/usr/local/bin/basename", "#!/bin/sh\necho 1\n", "755")],
                example_store, fleet)
    assert scored(traj) == (reward, None, None, "submitted"), traj.verifier_output


@on_both_runtimes(apptainer_lacks=NO_SERVICES)
def test_a_service_started_by_the_agent_is_graded_by_querying_it(tmp_path, example_store,
                                                                  fleet):
    """The agent starts ``python3 -m http.server`` on localhost (the task has no network: the
    sandbox's own network namespace, which the verifier shares) and the verifier grades
    what it serves over HTTP (the local runtime once kept the server frozen for the whole
    verification: the request timed out and the task scored 0)."""
    test_sh = textwrap.dedent("""\
        #!/bin/bash
        mkdir -p /logs/verifier
        echo 0 > /logs/verifier/reward.txt
        python3 - <<'EOF' > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
        import urllib.request
        url = "http://127.0.0.1:8766/answer.txt"
        print(urllib.request.urlopen(url, timeout=5).read().decode().strip())
        EOF
        """)
    task = copy_task(HELLO, tmp_path, test_sh=test_sh)
    start = ("mkdir -p /srv/www && echo 1 > /srv/www/answer.txt && cd /srv/www && "
             "(setsid python3 -m http.server 8766 --bind 127.0.0.1 </dev/null >/dev/null 2>&1 &)"
             " && for i in $(seq 100); do python3 -c 'import urllib.request as u; "
             "u.urlopen(\"http://127.0.0.1:8766/\")' 2>/dev/null && break; sleep 0.1; done"
             " && echo up")
    traj = roll(task, [start], example_store, fleet)
    assert "up" in outputs(traj)
    assert scored(traj) == (1.0, None, None, "submitted"), traj.verifier_output


@on_both_runtimes(apptainer_lacks=TMPFS_KILLS)
def test_filling_dev_shm_does_not_end_the_episode_as_an_infra_failure(example_store, fleet):
    """An agent that cannot solve the task submits with ``echo TMAX_TASK_COMPLETE; dd
    if=/dev/zero of=/dev/shm/fill bs=1M``. The episode scores the 0 the agent earned; it
    once ended as an infrastructure failure (masked in training; re-run, and left unscored
    when it keeps happening, in evaluation): the verifier found the sandbox dead (see
    test_filling_dev_shm_or_tmp_does_not_kill_the_sandbox)."""
    from tmax.agent.config import SUBMIT_MARKER

    commands = [f"echo {SUBMIT_MARKER}; dd if=/dev/zero of=/dev/shm/fill bs=1M status=none"]
    traj = roll(HELLO, commands, example_store, fleet)
    assert traj.infra_failure is None, traj.infra_failure
    assert (traj.reward, traj.end_reason) == (0.0, "submitted")


@on_both_runtimes()
def test_a_full_disk_does_not_end_the_episode_as_an_infra_failure(tmp_path, example_store,
                                                                   fleet):
    """An agent that fills its ``storage_mb`` (blocks with dd, then inodes with empty
    files) before it submits scores the 0 its work earns. (dd has a count: on Apptainer a
    dd without one never sees ENOSPC and runs until its command's timeout.) The local verifier's folders
    were once made on the sandbox's own disk: ``verify`` raised ENOSPC on the host and the
    episode was an infrastructure failure."""
    task = copy_task(HELLO, tmp_path, test_sh=(HELLO / "tests" / "test.sh").read_text())
    toml = (task / "task.toml").read_text()
    (task / "task.toml").write_text(toml.replace("[environment]\n",
                                                 "[environment]\nstorage_mb = 64\n"))
    fill = ("dd if=/dev/zero of=/fill bs=1M count=128 status=none; python3 -c '\n"
            "i = 0\n"
            "while True:\n"
            "    try:\n"
            "        open(f\"/i{i}\", \"w\").close(); i += 1\n"
            "    except OSError as e:\n"
            "        print(\"files\", i, e.strerror); break\n'")
    traj = roll(task, [fill], example_store, fleet)
    assert "No space left on device" in outputs(traj)
    assert scored(traj) == (0.0, None, None, "submitted"), \
        (scored(traj), traj.verifier_output[-500:])


@pytest.mark.parametrize("runtime_kind", ["local"], scope="module")
def test_many_names_at_the_root_do_not_end_the_episode_as_an_infra_failure(example_store,
                                                                            fleet):
    """6000 folders with 200-character names at / score the episode's 0. The local
    verifier once bound every top-level entry of the agent's root one by one on bwrap's
    command line, which grew past the kernel's limit (E2BIG): an infrastructure failure.
    Local only: about the local runtime's command line (Apptainer's binds do not grow with
    the agent's files; its 6000 mkdirs on fuse-overlayfs took 105 s here)."""
    make = ("python3 -c 'import os\n"
            "for i in range(6000): os.mkdir(\"/\" + \"x\" * 200 + str(i))' && ls / | wc -l")
    traj = roll(HELLO, [make], example_store, fleet)
    assert scored(traj) == (0.0, None, None, "submitted"), \
        (scored(traj), traj.verifier_output[-500:])
