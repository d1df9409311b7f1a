"""The verifier entered into its namespaces (``helper.py enter``), as the image's user,
attacked as the agent.

``LocalRuntime.verify`` now has bwrap build the verifier's namespaces and hold them with a
stopped process (``VERIFIER_HOLD``); the verifier's command is entered into them as root or
as ``verify(user=...)`` (ids from the IMAGE's /etc/passwd and /etc/group), without
capabilities, and for a non-root user nosuid is cleared on the image's own /usr, /bin,
/sbin and /lib* binds; once the command ends (or times out) the hold's pid 1 is killed. A
verifier whose working directory the agent made unusable starts in /.

The agent is root in its sandbox (or the image's USER) and hostile: it wants a higher
reward, or grading to fail as an error (errors are left out of training), or the host.
Attacked here:

1. set-user-ID-root (and file-capability) programs planted in the agent's folders;
2. a rewritten /etc/passwd and /etc/group, or a replaced /etc, choosing the verifier's ids;
3. the verifier's working directory replaced by links or a file;
4. a working directory below a link of the agent's: the host must not be written;
5. what the verifier's command leaves running, or a command that times out (setsid,
   nohup, double fork, a command that leaves its process group): verify returns and
   nothing of the verifier is left on the host;
6. the agent's processes (as the verifier's own uid, and as root) looking for the
   verifier in /proc to forge its reward, write to its output or kill it;
7. the OOM killer: the agent's processes must be its choice, not the entered verifier.

Every test asserts the secure behaviour. Seven found holes in the first version of this
change (a host folder made through a link above the workdir, a verify that never
returned after a command left its process group, the verifier as the OOM victim, and an
unusable workdir turned into an error); each was fixed and its test passes.
"""

# ruff: noqa: F811  (the fixtures imported from tests.integration.test_runtime are parameters here)
from __future__ import annotations

import itertools
import os
import shlex
import signal
import textwrap
import threading

import pytest

from tests.integration.test_runtime import dirs, make, run, runtime, user_sif  # noqa: F401  (fixtures)
from tests.seal_helpers import verify  # (test.sh as the verifier; result, reward)

_ids = itertools.count()


@pytest.fixture
def make_user(make, user_sif):
    """Sandboxes from ``user_sif`` (its user ``grader``: uid 1000, groups 1000 and 1001; a
    root-only /var/lib/secret/rate; a set-user-ID-root ``peek``); the agent is root unless
    ``user`` is given. All stopped after."""
    return lambda **spec: make(image=user_sif, **spec)


def as_root(runtime, sandbox_id, command: str, timeout: float = 60):
    """``command`` as root in the sandbox, whatever its user."""
    return runtime._exec(sandbox_id, command, timeout=timeout, root=True)


def daemon(script: str) -> str:
    """A shell command starting ``bash script`` detached from the command's group."""
    return f"setsid bash {script} </dev/null >/dev/null 2>&1 & disown; sleep 0.2"


def write_file(path: str, text: str) -> str:
    return f"mkdir -p $(dirname {path}) && cat > {path} <<'EOF_ATTACK'\n{text}EOF_ATTACK\n"


def host_pids_with(marker: str) -> list[int]:
    """Host pids whose command line holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            pass
    return found


# ---- 1. set-user-ID and file-capability programs the agent plants


PLANT_DIRS = ("/tmp", "/app", "/root", "/home/grader", "/var/tmp", "/opt/x")
PLANT = textwrap.dedent("""\
    set -e
    for d in {dirs}; do
      mkdir -p $d
      cp /bin/bash $d/sbash; cp /bin/cat $d/scat; cp "$(readlink -f /usr/bin/python3)" $d/cpy
      chown 0:0 $d/sbash $d/scat $d/cpy; chmod 4755 $d/sbash $d/scat
      # CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, effective (written by the sandbox's root:
      # the kernel stores it for that root, which is also the verifier's root on the host)
      python3 -c "import os, struct, sys; os.setxattr(sys.argv[1], 'security.capability',
    struct.pack('<IIIII', 0x02000001, 6, 0, 0, 0))" $d/cpy
      stat -c %a $d/sbash
    done
    chmod 0755 /root
    """)
PROBE = textwrap.dedent("""\
    for d in {dirs}; do
      $d/sbash -p -c 'echo "uid=$(id -u) euid=$EUID"' 2>&1
      $d/scat /var/lib/secret/rate 2>&1
      $d/cpy -c 'print(open("/var/lib/secret/rate").read().strip())' 2>&1 | tail -1
    done
    echo peek=$(peek /var/lib/secret/rate)
    echo 0.5 > /logs/verifier/reward.txt
    """)


@pytest.mark.sandbox
@pytest.mark.parametrize("many_names", [False, True], ids=["own-root", "agent-root-whole"])
def test_set_user_id_programs_the_agent_plants_give_the_verifier_nothing(
        runtime, make_user, tmp_path, many_names):
    """The agent (root) plants set-user-ID-root copies of bash and cat and a python with
    file capabilities in /tmp, /app, /root, the verifier's home, /var/tmp and /opt (and,
    with ``many_names``, > TOP_LEVEL_MAX names at /, so its root is bound whole): the
    verifier (grader) runs each and must stay uid 1000 and read no root-only file; the
    image's own set-user-ID ``peek`` works (the control)."""
    sid = make_user(workdir="/tmp")
    dirs_ = " ".join(PLANT_DIRS)
    planted = as_root(runtime, sid, PLANT.format(dirs=dirs_))
    assert planted.output.split() == ["4755"] * len(PLANT_DIRS), planted.output
    has_caps = as_root(runtime, sid, "python3 -c \"import os; "
                                     "print(len(os.getxattr('/tmp/cpy', 'security.capability')))\"")
    assert has_caps.output.strip() in ("20", "24"), has_caps.output
    if many_names:
        assert as_root(runtime, sid, "mkdir /n{1..600} && echo ok").output == "ok\n"
    result, reward = verify(runtime, sid, tmp_path, PROBE.format(dirs=dirs_), user="grader")
    assert reward == "0.5", result.output
    lines = result.output.splitlines()
    assert "peek=0.7" in lines, result.output  # the image's own set-user-ID program works
    assert [line for line in lines if "0.7" in line] == ["peek=0.7"], result.output
    assert not [line for line in lines if "uid=0" in line or "euid=0" in line], result.output


# ---- 2. the agent's /etc/passwd and /etc/group


@pytest.mark.sandbox
@pytest.mark.parametrize("how", ["rewritten", "etc-replaced-by-a-link"])
def test_the_agents_passwd_and_group_do_not_choose_the_verifiers_ids(runtime, make_user,
                                                                     tmp_path, how):
    """grader made uid 0 / gid 0, a member of root's, shadow's and disk's groups, its home
    /root, in the agent's files (or in a folder its /etc now links to): the verifier runs
    with the image's ids and home all the same."""
    sid = make_user(workdir="/tmp")
    forged = ("root:x:0:0:root:/root:/bin/bash\ngrader:x:0:0::/root:/bin/bash\n",
              ("root:x:0:grader\ngrader:x:0:\nstaff2:x:1001:\nshadow:x:42:grader\n"
               "disk:x:6:grader\n"))
    etc = "/etc" if how == "rewritten" else "/tmp/etc"
    setup = (f"mkdir -p {etc} && printf %s '{forged[0]}' > {etc}/passwd && "
             f"printf %s '{forged[1]}' > {etc}/group")
    if how != "rewritten":
        setup += " && rm -rf /etc && ln -s /tmp/etc /etc"
    out = as_root(runtime, sid, setup + " && echo ok")
    assert out.output.endswith("ok\n"), out.output
    result, reward = verify(runtime, sid, tmp_path,
                            "id -u; id -g; id -G; echo $HOME\n"
                            "cat /var/lib/secret/rate 2>/dev/null || echo no-read\n"
                            "echo 0 > /logs/verifier/reward.txt\n", user="grader")
    assert (result.exit_code, reward) == (0, "0"), result.output
    assert result.output.splitlines() == ["1000", "1000", "1000 1001", "/home/grader",
                                          "no-read"], result.output


# ---- 3. the verifier's working directory replaced


WORKDIR_ATTACKS = {
    # the verifier's own logs: it runs there, the agent still cannot write its reward
    "link-to-its-logs": "ln -s /logs/verifier /app",
    # a folder the agent controls: what it left there is graded
    "link-to-agent-folder": "mkdir -p /tmp/fake && ln -s /tmp/fake /app",
    # the verifier's pid 1 root (bwrap's init): bwrap itself could chdir there
    "link-to-proc-1-root": "ln -s /proc/1/root /app",
    # a folder the verifier's user may not enter
    "link-to-root-home": "chmod 0700 /root && ln -s /root /app",
    "dangling-link": "ln -s /nonexistent/app /app",
    "a-file": "echo not-a-folder > /app",
}


@pytest.mark.sandbox
@pytest.mark.parametrize("attack", [
    "link-to-its-logs", "link-to-agent-folder",
    "link-to-proc-1-root", "link-to-root-home", "dangling-link", "a-file",
])
def test_a_workdir_the_agent_replaced_is_graded_and_never_gives_it_the_reward(
        runtime, make_user, tmp_path, attack):
    """/app (the task's workdir) replaced by the agent (root) with a link or a file, and a
    process of its own writing 1 into /app/reward.txt and /logs/verifier/reward.txt all
    along: the verifier (grader) must start (a graded result, never an error the agent
    chose) and its own reward (0) must be the one read."""
    sid = make_user(workdir="/tmp")
    forger = "while :; do echo 1 > /app/reward.txt; echo 1 > /logs/verifier/reward.txt; done " \
             "2>/dev/null\n"
    out = as_root(runtime, sid, f"rm -rf /app && {WORKDIR_ATTACKS[attack]} && "
                                + write_file("/opt/forge.sh", forger) + daemon("/opt/forge.sh")
                                + " && echo ok")
    assert out.output.endswith("ok\n"), out.output
    result, reward = verify(runtime, sid, tmp_path,
                            "echo 0 > /logs/verifier/reward.txt; sleep 1; pwd -P\n",
                            user="grader", cwd="/app")
    assert result.exit_code == 0, result.output
    assert reward == "0", result.output


# ---- 4. a link above the working directory


@pytest.mark.sandbox
def test_a_link_above_the_workdir_makes_nothing_on_the_host(runtime, make_user,
                                                            tmp_path):
    """The task's workdir is /srv/work; the agent (root) makes /srv a link to an absolute
    path that is a folder of the host (not of the sandbox). The host builds the verifier's
    view as root: nothing may appear in that host folder, and the verifier is graded."""
    target = tmp_path / "host-only"
    target.mkdir()
    sid = make_user(workdir="/tmp")
    out = as_root(runtime, sid, f"rm -rf /srv && ln -s {target} /srv && "
                                f"ls /srv/ 2>&1 | grep -c 'No such'")
    assert out.output == "1\n", out.output  # (that folder is not in the sandbox)
    result, reward = verify(runtime, sid, tmp_path, "echo 0 > /logs/verifier/reward.txt\n",
                            user="grader", cwd="/srv/work")
    made = sorted(p.name for p in target.iterdir())
    assert made == [], f"the host made {made} in {target}; verifier: {result.output}"
    assert reward == "0", result.output


# ---- 5. what the verifier leaves running, and its timeout


LEFT = {
    "setsid": "setsid bash -c 'exec -a {m} sleep 600' </dev/null >/dev/null 2>&1 &\n",
    "nohup": "nohup bash -c 'exec -a {m} sleep 600' </dev/null >/dev/null 2>&1 &\n",
    "double-fork": "( ( exec -a {m} sleep 600 ) </dev/null >/dev/null 2>&1 & ) &\n",
    "holds-its-output": "setsid bash -c 'exec -a {m} sleep 600' &\n",
    "python-daemon": ("python3 -c 'import os, sys, time\n"
                      "if os.fork(): sys.exit()\nos.setsid()\n"
                      "if os.fork(): sys.exit()\nos.execvp(\"sleep\", [\"{m}\", \"600\"])'\n"),
}
TIMES_OUT = {
    "times-out": "exec -a {m} sleep 600\n",
    # a child that leaves the group and keeps the output, test.sh waiting on it
    "times-out-child-setsid": ("python3 -c 'import os; os.setsid(); "
                               "os.execvp(\"sleep\", [\"{m}\", \"600\"])'\n"),
    # test.sh itself (the entered command) leaves the group, keeping the output
    "times-out-command-setsid": "exec setsid bash -c 'exec -a {m} sleep 600'\n",
}


@pytest.mark.sandbox
@pytest.mark.parametrize("mode", [
    *LEFT, "times-out", "times-out-child-setsid",
    "times-out-command-setsid",
])
def test_nothing_the_verifier_leaves_outlives_verify(runtime, make_user, tmp_path,
                                                     mode):
    """The verifier (grader) leaves a process behind (setsid, nohup, a double fork, one
    holding its output, a daemonizing python) and exits, or runs past its timeout (itself,
    a child in a session of its own, or after making itself a session leader): verify
    returns (timed out for those), and no process of the verifier is left on the host."""
    marker = f"tmaxatk{os.getpid()}x{next(_ids)}"
    script = {**LEFT, **TIMES_OUT}[mode].format(m=marker)
    times_out = mode in TIMES_OUT
    sid = make_user(workdir="/tmp")
    got: dict = {}

    def go() -> None:
        try:
            got["v"] = verify(runtime, sid, tmp_path,
                              script + "echo 0 > /logs/verifier/reward.txt\n",
                              user="grader", timeout=4 if times_out else 60)
        except BaseException as e:  # noqa: BLE001
            got["e"] = e

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(120)
    hung = thread.is_alive()
    if hung:  # end what this test started, so the sandbox can be stopped
        for pid in host_pids_with(marker):
            os.kill(pid, signal.SIGKILL)
        thread.join(60)
    assert not hung, "verify did not return"
    assert "e" not in got, got.get("e")
    result, reward = got["v"]
    assert result.timed_out is times_out, result.output
    if not times_out:
        assert (result.exit_code, reward) == (0, "0"), result.output
    assert host_pids_with(marker) == [], "a process of the verifier outlived it"


# ---- 6. the agent's processes hunting the verifier


WATCHER = textwrap.dedent("""\
    while :; do
      echo x >> /tmp/beat-$1
      for d in /proc/[0-9]*; do
        p=${d#/proc/}
        c=$(tr '\\0' ' ' < $d/cmdline 2>/dev/null) || continue
        case "$c" in
          *test.sh*|*verifier-sleep*)
            echo "SAW $p $c" >> /tmp/saw
            echo 1 > $d/root/logs/verifier/reward.txt
            echo INJECTED > $d/fd/1
            kill -STOP $p; kill -9 $p ;;
        esac
      done
    done 2>/dev/null
    """)


@pytest.mark.sandbox
def test_the_agents_processes_as_the_verifiers_uid_cannot_reach_it(runtime, make_user,
                                                                  tmp_path):
    """The agent is the image's USER, grader, the verifier's uid on the host too. A watcher
    of its (and one as root) scans /proc for the verifier to forge its reward through
    /proc/PID/root, write into its output through /proc/PID/fd/1, stop and kill it;
    then one signals everything it can (kill -1). The verifier runs 2 s, its reward and
    output are its own, and the watchers ran all along."""
    sid = make_user(user="grader", workdir="/tmp")
    assert run(runtime, sid, "id -u").output == "1000\n"
    assert as_root(runtime, sid, write_file("/opt/watch.sh", WATCHER) + "echo ok"
                   ).output == "ok\n"
    run(runtime, sid, "setsid bash /opt/watch.sh grader </dev/null >/dev/null 2>&1 & "
                      "disown; sleep 0.2")
    as_root(runtime, sid, "setsid bash /opt/watch.sh root </dev/null >/dev/null 2>&1 & "
                          "disown; sleep 0.2")
    test_sh = ("echo 0 > /logs/verifier/reward.txt\n"
               "wc -l < /tmp/beat-grader; wc -l < /tmp/beat-root\n"
               "bash -c 'exec -a verifier-sleep sleep 2'\n"
               "wc -l < /tmp/beat-grader; wc -l < /tmp/beat-root\n"
               "echo 0.25 > /logs/verifier/reward.txt\n")
    result, reward = verify(runtime, sid, tmp_path, test_sh, user="grader")
    assert (result.exit_code, reward) == (0, "0.25"), result.output
    assert "INJECTED" not in result.output
    g0, r0, g1, r1 = map(int, result.output.split())
    assert g1 > g0 and r1 > r0, "the agent's processes were stopped while the verifier ran"
    assert as_root(runtime, sid, "cat /tmp/saw 2>/dev/null; echo checked").output == \
        "checked\n"
    run(runtime, sid, write_file("/tmp/sig.sh", "while :; do kill -STOP -1; kill -KILL -1; "
                                                "done 2>/dev/null\n")
        + "setsid bash /tmp/sig.sh </dev/null >/dev/null 2>&1 & disown; sleep 0.2")
    result, reward = verify(runtime, sid, tmp_path, test_sh.replace(
        "wc -l < /tmp/beat-grader; wc -l < /tmp/beat-root\n", ""), user="grader")
    assert (result.exit_code, reward) == (0, "0.25"), result.output


# ---- 7. the OOM killer


BIG_PYTHONS = textwrap.dedent("""\
    import glob
    big = 0
    for status in glob.glob("/proc/[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in open(status) if ":" in line)
        except OSError:
            continue
        if fields["Name"].strip() == "python3" and int(fields.get("VmRSS", "0 kB").split()[0]) > 45000:
            big += 1
    print(big)
    """)


@pytest.mark.sandbox
def test_the_agents_memory_holders_are_the_oom_victims_not_the_verifier(runtime, make,
                                                                        tmp_path):
    """The agent leaves four processes holding 50 MB each in its 320 MB sandbox; the
    verifier (root) needs 130 MB at once: the sandbox's memory cgroup runs out, and the
    OOM killer must take the agent's processes, not the verifier."""
    sid = make(memory_mb=320)
    hold = "python3 -c 'import time; b = b\"\\1\" * (50 << 20); time.sleep(600)'"
    out = run(runtime, sid, "for i in 1 2 3 4; do setsid " + hold +
              " </dev/null >/dev/null 2>&1 & done; sleep 3; python3 -c " + shlex.quote(BIG_PYTHONS))
    assert out.output.strip() == "4", out.output
    result, reward = verify(runtime, sid, tmp_path,
                            "python3 -c 'b = b\"\\1\" * (130 << 20); print(len(b) >> 20)' && "
                            "echo 1 > /logs/verifier/reward.txt || "
                            "echo 0 > /logs/verifier/reward.txt\n")
    assert reward == "1", result.output
