"""The verifier beside the sandbox, attacked by the agent's root, on the local and the
apptainer runtime (issues 11 and 32): its processes out of the agent's sight and reach, the
image's system tools over the agent's, files and links the agent leaves at /, the verifier's
own /tests, a service the agent started, output larger than a pipe. The PATH folders outside
/usr are in tests/integration/test_seal_path.py, the same attacks through the rollout path in
tests/integration/test_seal_rollout.py. An attack the apptainer runtime (as root) does not stop is a
strict expected failure there, naming the guarantee it lacks (tests/seal_helpers.py).
"""

from __future__ import annotations

import textwrap

import pytest

from tests.seal_helpers import (  # noqa: F401  (fixtures)
    FORGE_PY,
    FORGE_SH,
    NO_HOSTNAME,
    NO_ROOT_FILES_ASIDE,
    NO_SERVICES,
    TESTS_A_MOUNT,
    UNMOUNT_ETC,
    daemon,
    kind,
    on_both_runtimes,
    run,
    sealed_make,
    sealed_runtime,
    verify,
    write_file,
)

pytestmark = pytest.mark.sandbox


@pytest.mark.slow
@on_both_runtimes()
def test_the_verifier_is_out_of_sight_and_reach_of_the_agents_processes(runtime, make,
                                                                        tmp_path):
    """A watcher scans /proc for the verifier (test.sh, its sleep) to forge its reward
    through /proc/PID/root and to kill it, and a second loop signals everything it can
    (kill -KILL -1, kill -STOP -1). The verifier runs 2 s and gets its own reward. On the
    local runtime the agent's processes run on beside it (the watcher's heartbeat moves,
    else this proves nothing); on Apptainer they all end before it starts (the heartbeat
    stands still and the watcher is gone after)."""
    sid = make()
    watcher = textwrap.dedent("""\
        while :; do
          echo x >> /opt/beat
          for d in /proc/[0-9]*; do
            p=${d#/proc/}
            c=$(tr '\\0' ' ' < $d/cmdline 2>/dev/null) || continue
            case "$c" in
              *test.sh*|*verifier-sleep*)
                echo "SAW $p $c" >> /opt/saw
                echo 1 > $d/root/logs/verifier/reward.txt
                kill -9 $p ;;
            esac
          done
        done
        """)
    signaller = "while :; do kill -STOP -1; kill -KILL -1; done 2>/dev/null\n"
    run(runtime, sid, write_file("/opt/watch.sh", watcher) + "; " + daemon("/opt/watch.sh"))
    test_sh = ("echo 0 > /logs/verifier/reward.txt\n"
               "wc -l < /opt/beat\n"
               "bash -c 'exec -a verifier-sleep sleep 2'\n"
               "wc -l < /opt/beat\n"
               "echo 0.25 > /logs/verifier/reward.txt\n")
    result, reward = verify(runtime, sid, tmp_path, test_sh)
    assert (result.exit_code, reward) == (0, "0.25"), result.output
    before, after = map(int, result.output.split())
    watching = run(runtime, sid, "cat /opt/saw 2>/dev/null; "
                                 "pgrep -x -f 'bash /opt/watch.sh' >/dev/null && echo watching"
                   ).output
    if kind(runtime) == "local":
        # the watcher ran all along (else this proves nothing): see the service tests
        assert after > before, "the agent's processes were stopped while the verifier ran"
        # it did not see the verifier, and the verifier saw none of the agent's processes
        assert watching == "watching\n"
    else:  # every agent process ended before the verifier started
        assert (after, watching) == (before, ""), (before, after, watching)
    run(runtime, sid, write_file("/opt/sig.sh", signaller) + "; " + daemon("/opt/sig.sh"))
    result, reward = verify(runtime, sid, tmp_path, test_sh.replace("wc -l < /opt/beat\n",
                                                                    ""))
    assert (result.exit_code, reward) == (0, "0.25"), result.output


@on_both_runtimes()
def test_the_verifier_gets_the_images_system_tools_and_the_agents_files(runtime, make,
                                                                       tmp_path):
    """/usr/bin/python3 and /bin/bash replaced, /etc/alternatives/awk and
    /etc/ld.so.preload rewritten, a sitecustomize.py in /etc/python3.11, files at / and
    /logs/verifier pre-created: the verifier runs the image's tools over the agent's work.
    (A /conftest.py at /: test_files_at_the_root_are_not_the_verifiers.)"""
    sid = make(workdir="/app")
    attack = "; ".join([
        "mkdir -p /app && echo 'the agent wrote this' > /app/answer.txt",
        write_file("/opt/forge", FORGE_SH, "755"),
        "rm -f /usr/bin/python3 && cp /opt/forge /usr/bin/python3",
        "cp /opt/forge /usr/local/bin/python3",
        "ln -sf /opt/forge /etc/alternatives/awk",
        "echo /opt/agent-preload.so > /etc/ld.so.preload",
        write_file("/etc/python3.11/sitecustomize.py", FORGE_PY),
        write_file("/logs/verifier/reward.txt", "1\n"),
        "cp /opt/forge /usr/bin/bash.new && mv -f /usr/bin/bash.new /usr/bin/bash",
    ])
    assert run(runtime, sid, attack).exit_code == 0
    test_sh = textwrap.dedent("""\
        echo 0 > /logs/verifier/reward.txt
        cat /app/answer.txt
        awk 'BEGIN { print "awk-ok" }'
        python3 -c 'import sys; print("python-ok", sys.version_info[0])'
        python3 -c 'print(0.5)' > /logs/verifier/reward.txt
        """)
    result, reward = verify(runtime, sid, tmp_path, test_sh)
    assert reward == "0.5", (reward, result.output)
    assert result.output.splitlines() == ["the agent wrote this", "awk-ok", "python-ok 3"], \
        result.output  # nothing from the loader about the agent's ld.so.preload either
    # the agent's sandbox keeps its changes: on the local runtime what would have shaped
    # the verifier's tools where the image has nothing (its ld.so.preload) is set aside, not
    # lost; on Apptainer the verifier's view never touched the agent's files
    names = run(runtime, sid, ["/bin/ls", "-a", "/etc"]).output.split()  # (its bash is
    aside = [n for n in names if n.startswith(".tmax-set-aside-")]     # the forge)
    if kind(runtime) == "local":
        assert [n.rsplit("-", 1)[0] for n in aside] == [".tmax-set-aside-ld.so.preload"], names
        preload = f"/etc/{aside[0]}"
    else:
        assert aside == [], names
        preload = "/etc/ld.so.preload"
    # (on Apptainer the agent's loader complains about its own preload list first)
    assert run(runtime, sid, ["/bin/cat", preload, "/app/answer.txt"]).output.endswith(
        "/opt/agent-preload.so\nthe agent wrote this\n")


@on_both_runtimes()
def test_agent_system_opt_in_shows_the_agents_system_tools(runtime, make, tmp_path):
    """An agent's program with the name of one of the image's (``basename``, before the
    image's /usr/bin/basename on PATH) runs for the verifier only with ``agent_system``; a
    program the image has not (``agent-tool``) the local verifier sees as it sees the
    agent's other additions (``sandfleet.verifier.additions``), the Apptainer one does not
    (its ``NOT_GUARANTEED``)."""
    sid = make()
    run(runtime, sid, write_file("/usr/local/bin/basename", "#!/bin/sh\necho 1\n", "755")
        + " && " + write_file("/usr/local/bin/agent-tool", "#!/bin/sh\necho 1\n", "755"))
    test_sh = ("echo 0 > /logs/verifier/reward.txt\n"
               "basename /x/0 > /tmp/r && mv /tmp/r /logs/verifier/reward.txt\n")
    assert verify(runtime, sid, tmp_path, test_sh)[1] == "0"
    assert verify(runtime, sid, tmp_path, test_sh, agent_system=True)[1] == "1"
    new_sh = ("echo 0 > /logs/verifier/reward.txt\n"
              "agent-tool > /tmp/r && mv /tmp/r /logs/verifier/reward.txt\n")
    seen = verify(runtime, sid, tmp_path, new_sh)[1]
    assert seen == ("0" if kind(runtime) == "apptainer" else "1")


@on_both_runtimes()
def test_a_symlinked_etc_does_not_give_the_verifier_the_agents_interpreter_config(
        runtime, make, tmp_path):
    """An agent that replaces /etc with a symlink to a copy (``cp -a /etc /etc2; <edit
    /etc2/python3.11/sitecustomize.py>; rm -rf /etc; ln -s /etc2 /etc``) once got its whole
    /etc into the local verifier (the image's /etc entries were swapped in only over a
    directory): Debian's /usr/lib/python3.11/sitecustomize.py links to
    /etc/python3.11/sitecustomize.py, so every python3 the verifier ran executed the agent's
    atexit hook writing 1 over the verifier's 0.5."""
    sid = make()
    attack = ("cp -a /etc /etc2 2>/dev/null; "
              + write_file("/etc2/python3.11/sitecustomize.py", FORGE_PY)
              + " && echo /opt/agent-preload.so > /etc2/ld.so.preload"
              + " && " + UNMOUNT_ETC
              + "(rm -rf /etc || mv /etc /etc.old) && ln -s /etc2 /etc && echo swapped")
    out = run(runtime, sid, attack).output
    # (on Apptainer as root /etc cannot go: its shadow files' group is not mapped inside,
    # so they cannot be removed; but the rest of it can: see the next test)
    assert out.endswith("swapped\n") or kind(runtime) == "apptainer", out
    test_sh = "python3 -c 'open(\"/logs/verifier/reward.txt\", \"w\").write(\"0.5\")'\n"
    result, reward = verify(runtime, sid, tmp_path, test_sh)
    # both are the agent's: its sitecustomize forged the reward, its preload list was read
    assert (reward, "ld.so.preload" in result.output) == ("0.5", False), result.output


@on_both_runtimes()
def test_a_system_folder_the_agent_removed_does_not_stop_the_verifier(runtime, make, tmp_path):
    """The image's /etc entries go over the agent's; one the agent removed is the image's
    for the verifier all the same (on Apptainer its bind had no destination left and the
    verifier's container did not start: an episode with no reward, left out of the loss;
    the runtime now makes the destination again and runs the verifier)."""
    gone = "/etc/apt"  # (/etc/python3.11 too: the same on both runtimes)
    sid = make()
    run(runtime, sid, f"rm -rf {gone}")
    result, reward = verify(runtime, sid, tmp_path, f"test -d {gone} && echo 1 > "
                                                    "/logs/verifier/reward.txt\n")
    assert (result.exit_code, reward) == (0, "1"), result.output


@on_both_runtimes(apptainer_lacks=NO_ROOT_FILES_ASIDE)
@pytest.mark.parametrize("how", ["file", "link"])
def test_files_at_the_root_are_not_the_verifiers(runtime, make, tmp_path, how):
    """A /conftest.py (a regular file, or a link to the agent's code: the local verifier
    once recreated links at / as they were) and a /pytest.ini the agent puts at / are not
    in the verifier's root, where pytest's rootdir conftest discovery from /tests up to /
    would import them."""
    sid = make()
    place = "ln -s /opt/c.py /conftest.py" if how == "link" else "cp /opt/c.py /conftest.py"
    run(runtime, sid, write_file("/opt/c.py", FORGE_PY) + f" && {place} && "
                      + write_file("/pytest.ini", "[pytest]\n"))
    test_sh = ("echo 0 > /logs/verifier/reward.txt\n"
               "for f in /conftest.py /pytest.ini; do test -e $f && echo visible $f; done\n"
               "if test -e /conftest.py; then python3 /conftest.py; fi\n")  # as pytest would
    result, reward = verify(runtime, sid, tmp_path, test_sh)
    assert "visible" not in result.output and reward == "0", (reward, result.output)


@on_both_runtimes(apptainer_lacks=TESTS_A_MOUNT)
def test_the_verifiers_tests_are_a_plain_folder_it_can_move_away_and_back(runtime, make,
                                                                         tmp_path):
    """A real task's test.sh hides /tests while it runs the agent's program (mv /tests
    /tmp/tests.hidden, then back), as it could in Docker: /tests is a folder on the
    verifier's own root, not a mount point (which refused the move, or let `mv` copy it
    into itself). The agent's /app and /tmp are the verifier's: what one writes the other
    reads. The agent's own /tests is not the verifier's, and never sees the tests."""
    sid = make(workdir="/app")
    run(runtime, sid, "mkdir -p /app /tests && echo agent > /app/answer && "
                      "echo planted > /tests/test_outputs.py")
    test_sh = textwrap.dedent("""\
        set -e
        mv /tests /tmp/tests.hidden
        test ! -e /tests
        cat /app/answer
        echo graded > /app/graded
        mv /tmp/tests.hidden /tests
        ls /tests
        stat -c %m /tests
        rm -rf /tests && test ! -e /tests
        echo 1 > /logs/verifier/reward.txt
        """)
    result, reward = verify(runtime, sid, tmp_path, test_sh)
    assert (reward, result.output.split()) == ("1", ["agent", "test.sh", "/"]), result.output
    assert run(runtime, sid, "cat /app/graded /tests/test_outputs.py; ls -a /tmp").output \
        .split() == ["graded", "planted", ".", ".."]


@on_both_runtimes()
def test_the_agents_tmp_and_var_tmp_reach_the_verifier_and_count_in_its_quota(runtime, make,
                                                                               tmp_path):
    """As in a container, /tmp and /var/tmp are part of the agent's files: what the agent
    leaves there is graded (Apptainer's --containall made them a tmpfs of the instance,
    gone when it stopped for the verifier), and fills its ``storage_mb``."""
    sid = make(storage_mb=64)
    run(runtime, sid, "echo tmp > /tmp/answer && echo var-tmp > /var/tmp/answer")
    test_sh = "cat /tmp/answer /var/tmp/answer\necho 1 > /logs/verifier/reward.txt\n"
    result, reward = verify(runtime, sid, tmp_path, test_sh)
    assert (reward, result.output) == ("1", "tmp\nvar-tmp\n"), result.output
    assert run(runtime, sid, "cat /tmp/answer").output == "tmp\n"
    fill = run(runtime, sid, "dd if=/dev/zero of=/tmp/fill bs=1M count=128 status=none")
    assert "No space left on device" in fill.output, fill.output


@on_both_runtimes(apptainer_lacks=NO_SERVICES)
def test_a_service_the_agent_started_answers_the_verifier(runtime, make, tmp_path):
    """The agent's HTTP server on localhost answers the verifier's request (the local
    verifier once kept the agent frozen while it ran: the request timed out, reward 0)."""
    sid = make()
    server = textwrap.dedent("""\
        import http.server
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200); self.end_headers(); self.wfile.write(b"0.75")
        http.server.HTTPServer(("127.0.0.1", 8765), H).serve_forever()
        """)
    start = (write_file("/opt/srv.py", server) + " && (setsid python3 /opt/srv.py "
             "</dev/null >/dev/null 2>&1 &) && for i in $(seq 100); do "
             "python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 8765))' "
             "2>/dev/null && break; sleep 0.1; done && rm /opt/srv.py && echo up")
    assert run(runtime, sid, start).output.endswith("up\n")
    test_sh = ("echo 0 > /logs/verifier/reward.txt\n"
               "python3 -c 'import urllib.request as u; "
               "print(u.urlopen(\"http://127.0.0.1:8765/\", timeout=5).read().decode())' "
               "> /logs/verifier/reward.txt\n")
    result, reward = verify(runtime, sid, tmp_path, test_sh)
    assert reward == "0.75", result.output


@on_both_runtimes()
def test_a_verifier_with_more_output_than_a_pipe_holds_is_not_timed_out(runtime, make,
                                                                        tmp_path):
    """A verifier printing more than a pipe holds (64 KiB) is read as it runs: the local
    runtime once read its output only after the verifier's start was confirmed, which never
    came, so it came back timed out (exit 124, a fake 0) though it had written its reward."""
    sid = make()
    test_sh = "seq 1 50000\necho 1 > /logs/verifier/reward.txt\n"  # ~290 KB of output
    result, reward = verify(runtime, sid, tmp_path, test_sh, timeout=10)
    assert (result.timed_out, result.exit_code, reward) == (False, 0, "1")
    assert result.output.startswith("1\n2\n") and result.output.endswith("\n50000\n")


@on_both_runtimes(apptainer_lacks=NO_HOSTNAME)
def test_localhost_and_the_sandboxs_name_resolve_for_the_agent_and_the_verifier(
        runtime, make, tmp_path):
    """A debootstrapped image's /etc/hosts is empty, and `localhost` then resolves nowhere
    (a real Harbor task's tests failed on it); the sandbox gets Docker's lines in its own
    layer, which the agent may change as in a container."""
    sid = make()
    v4 = "python3 -c 'import socket; print(socket.gethostbyname(\"localhost\"))'"
    out = run(runtime, sid, f"{v4}; getent hosts \"$(hostname)\" | cut -d' ' -f1; "
                            "ls -l /etc/hosts | cut -d' ' -f3").output.split()
    assert out == ["127.0.0.1", "127.0.1.1", "root"], out
    result, reward = verify(runtime, sid, tmp_path, f"{v4} > /logs/verifier/reward.txt\n")
    assert reward.strip() == "127.0.0.1", result.output
