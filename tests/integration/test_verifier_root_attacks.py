"""The verifier's own root, attacked as the agent.

``VERIFIER_SH`` builds a folder "top" on the verifier's tmpfs: a plain copy of the tests
at tests/, and each top-level entry of the agent's (frozen) root but tests, dev, proc and
those the image's own cover (a folder or regular file bound by bwrap, a link made anew
with the same target); that folder is the verifier's /. The verifier's mounts below the top level
sit on the agent's own files and folders, which are made immutable while it runs (the
thawed agent cannot remove them, which would detach the mounts). Past ``TOP_LEVEL_MAX``
top-level entries the agent's root is bound whole instead, with the tests over its
/tests, and the agent stays frozen until the verifier ends.

Every test asserts the secure behaviour.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap

import pytest

import tests.seal_helpers as seal
from tests.seal_helpers import FORGE_PY, daemon, run, verify, write_file

dirs, runtime, make = seal.dirs, seal.runtime, seal.make  # tests.seal_helpers' local runtime, for ours


# ---- 1. hostile top-level names, links, fifos, sockets, hard links

HOSTILE_DIRS = ["-rf", "--bind", "a b", "new\nline", "tab\there", "*", "[x]", ".[!.]*",
                "..?*", "...", "a,ro", "LABEL=x", "x:y", "$(touch .pwn)", "back\\slash",
                "-", "tests ", "Tests", ".tmax-x", "trail\n", "x" * 255]
HOSTILE_FILES = ["-n", "f\nfile", "*.txt", "--help"]


@pytest.mark.sandbox
@pytest.mark.parametrize("agent_system", [False, True], ids=["image-system", "agent-system"])
def test_hostile_top_level_entries_are_bound_or_copied_as_themselves(
        runtime, make, tmp_path, agent_system):
    """Folders with names that a shell, mount(8), a glob or bwrap's mountinfo parser could
    misread; regular files; links (absolute to a host-only folder, into /proc/1/root,
    relative, dangling, a loop); a fifo and a socket; a hard link. The host builds the view
    as root: it must follow none of the links (the host folder stays as it was), hang on
    no fifo, and the verifier must see each folder as the agent's (its file inside), each
    link as a link whose target resolves in its own root (never into the host folder), and
    its own tests. Where the image's system is used, the agent's top-level files and links
    the image has not are set aside (renamed); with agent_system they are the verifier's."""
    host = tmp_path / "host-only"
    host.mkdir()
    (host / "host-secret").write_text("host")
    spec = {"dirs": HOSTILE_DIRS, "files": HOSTILE_FILES,
            "links": {"l-host": str(host), "l-host-rel": "../../../../../.." + str(host),
                      "l-proc": "/proc/1/root", "l-dangle": "/nonexistent/x",
                      "l-rel": "tmp", "l-loop": "l-loop", "-l": "/etc"}}
    agent = textwrap.dedent("""\
        import json, os, socket, sys
        spec = json.loads(sys.argv[1])
        for n in spec["dirs"]:
            os.mkdir("/" + n)
            open(f"/{n}/inside", "w").write("dir " + n)
        for n in spec["files"]:
            open("/" + n, "w").write("file " + n)
        for n, target in spec["links"].items():
            os.symlink(target, "/" + n)
        os.mkfifo("/fifo")
        socket.socket(socket.AF_UNIX).bind("/sock")
        open("/var/tmp/h", "w").write("hard")
        os.link("/var/tmp/h", "/hard")
        print("ok")
        """)
    sid = make()
    out = run(runtime, sid, ["python3", "-c", agent, json.dumps(spec)])
    assert out.output.strip() == "ok", out.output
    probe = textwrap.dedent("""\
        import json, os
        seen = {}
        for n in os.listdir("/"):
            p = "/" + n
            if os.path.islink(p):
                try:
                    listing = sorted(os.listdir(p))[:5]
                except OSError as e:
                    listing = e.strerror
                seen[n] = ["link", os.readlink(p), listing]
            elif os.path.isdir(p):
                inside = p + "/inside"
                seen[n] = ["dir", open(inside).read() if os.path.isfile(inside) else None]
            elif os.path.isfile(p):
                seen[n] = ["file", open(p).read()]
            else:
                seen[n] = ["other"]
        seen["/tests"] = sorted(os.listdir("/tests"))
        print(json.dumps(seen))
        open("/logs/verifier/reward.txt", "w").write("1")
        """)
    result, reward = verify(runtime, sid, tmp_path, "python3 /tests/probe.py\n",
                            {"probe.py": probe}, agent_system=agent_system)
    assert (result.exit_code, reward) == (0, "1"), result.output
    seen = json.loads(result.output.strip().splitlines()[-1])
    assert seen.pop("/tests") == ["probe.py", "test.sh"]
    for n in HOSTILE_DIRS:
        assert seen.get(n) == ["dir", "dir " + n], (n, seen.get(n))
    for n in HOSTILE_FILES + ["hard"]:
        expected = ["file", "hard" if n == "hard" else "file " + n] if agent_system else None
        assert seen.get(n) == expected, (n, seen.get(n))
    for n, target in spec["links"].items():
        if not agent_system:
            assert n not in seen, (n, seen[n])
            continue
        assert seen[n][:2] == ["link", target], (n, seen[n])
        assert "host-secret" not in json.dumps(seen[n]), (n, seen[n])
    assert "fifo" not in seen and "sock" not in seen, seen
    # nothing of the host's came through, and the host followed no link into its folder
    assert sorted(p.name for p in host.iterdir()) == ["host-secret"]
    assert "host-secret" not in result.output
    after = run(runtime, sid, "ls -A / | grep -c .tmax-set-aside-; cat '/-rf/inside'"
                ).output.split("\n")
    aside = len(HOSTILE_FILES) + len(spec["links"]) + 3  # files, links, fifo, socket, hard
    assert after[:2] == [str(0 if agent_system else aside), "dir -rf"], after


# ---- 2. an agent process running beside the verifier


DAEMON = textwrap.dedent("""\
    while :; do
      echo x >> /var/tmp/beat
      [ -e /conftest.py ] || cp /var/tmp/c.py /conftest.py
      [ -e /pytest.ini ] || printf '[pytest]\\n' > /pytest.ini
      rm -rf /var/tmp/t.new; mkdir -p /var/tmp/t.new /logs/verifier
      cp /var/tmp/c.py /var/tmp/t.new/conftest.py; rm -rf /tests; mv /var/tmp/t.new /tests
      echo 1 > /logs/verifier/reward.txt
      if [ -e /verifier-made ]; then cp /verifier-made /var/tmp/leaked; fi
      sleep 0.02
    done
    """)
"""Recreates at / what the host set aside while it was frozen (/conftest.py, /pytest.ini:
pytest would load a rootdir conftest from /), replaces its /tests (removing a folder that
is a mount point in another mount namespace detaches that mount) with one holding a
conftest.py, writes its /logs/verifier, and copies out what the verifier makes at /."""


@pytest.mark.sandbox
@pytest.mark.parametrize("entries", [512, 513])
def test_an_agent_process_changes_nothing_at_the_verifiers_root(runtime, make, tmp_path,
                                                               entries):
    """A daemon of the agent's puts /conftest.py and /pytest.ini back at / (the host set
    them aside while it was frozen), replaces its /tests with a folder holding a
    conftest.py, writes its /logs/verifier/reward.txt, and watches for what the verifier
    makes at /. With ``entries`` top-level names in all (the agent pads / with empty
    folders): at 512 the verifier's / is its own folder, the agent runs on beside it and
    changes nothing the verifier sees. At 513 (more than ``TOP_LEVEL_MAX``) the agent's
    live root is the verifier's /, so the agent stays frozen until the verifier ends
    (it chose the layout by the number of names it left at /)."""
    sid = make()
    run(runtime, sid, write_file("/var/tmp/c.py", FORGE_PY) + "; "
        + write_file("/opt/d.sh", DAEMON) + "; " + daemon("/opt/d.sh"))
    # names at / but tests (which the daemon removes and remakes), which the host makes;
    # the daemon builds the new one in /var/tmp, so that no name of its own comes and goes
    # at / (a /t.new beside /tests at the freeze once made 513 names of the 512)
    names = "ls -A / | grep -cvx tests"
    pad = (f"while ! [ -e /pytest.ini ]; do sleep 0.05; done; n=$({names}) && "
           f"for i in $(seq 1 $(({entries} - 1 - n))); do mkdir /pad$i; done && {names}")
    assert run(runtime, sid, pad).output.split()[-1] == str(entries - 1)
    test_sh = textwrap.dedent("""\
        echo 0.25 > /logs/verifier/reward.txt
        b1=$(wc -l < /var/tmp/beat)
        echo made > /verifier-made
        sleep 1.5
        ls /tests
        test -e /conftest.py && echo visible /conftest.py
        b2=$(wc -l < /var/tmp/beat)
        [ "$b2" -gt "$b1" ] && echo agent-ran
        if test -e /conftest.py; then python3 /conftest.py; fi  # as pytest would
        """)
    result, reward = verify(runtime, sid, tmp_path, "stat -c %m /tests\n" + test_sh)
    layout, *output = result.output.split()
    assert layout == ("/" if entries <= 512 else "/tests"), result.output  # as meant
    ran = ["agent-ran"] if entries <= 512 else []  # (frozen past TOP_LEVEL_MAX)
    assert output == ["test.sh", *ran] and reward == "0.25", (reward, result.output)
    if entries <= 512:  # (at 513 the verifier wrote into the agent's root, as in Docker,
        # and the agent reads it once thawed, after the verifier ended)
        assert run(runtime, sid, "cat /var/tmp/leaked 2>&1").output.startswith("cat:"), \
            "the agent read what the verifier wrote at /"


@pytest.mark.sandbox
def test_a_preload_list_the_agent_puts_back_after_the_freeze_is_not_the_verifiers(
        runtime, make, tmp_path):
    """/etc/ld.so.preload decides which library every program loads first; the image has
    none. The agent's /etc is the verifier's (bound, live), and the thawed agent's daemon
    writes /etc/ld.so.preload again, naming a library whose destructor would turn the
    verifier's 0.5 into 1: the verifier gets an empty preload list of its own over an
    empty, immutable file in the agent's /etc (``LOADER_ETC``)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler on this machine")
    src = tmp_path / "forge.c"
    src.write_text(textwrap.dedent("""\
        static long sys3(long n, long a, long b, long c) {
            long r;
            __asm__ volatile ("syscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c)
                              : "rcx", "r11", "memory");
            return r;
        }
        __attribute__((destructor)) static void forge(void) {
            long fd = sys3(2, (long)"/logs/verifier/reward.txt", 01 | 0100 | 01000, 0644);
            if (fd >= 0) { sys3(1, fd, (long)"1\\n", 2); sys3(3, fd, 0, 0); }
        }
        """))
    lib = tmp_path / "forge.so"
    subprocess.run([cc, "-shared", "-fPIC", "-nostdlib", "-O2", "-o", str(lib), str(src)],
                   check=True, timeout=60)
    sid = make()
    put = run(runtime, sid, "cat > /var/tmp/forge.so && echo /var/tmp/forge.so > "
                            "/etc/ld.so.preload && echo put", stdin=lib.read_bytes())
    assert put.output.endswith("put\n"), put.output
    keeper = ("while :; do [ -e /etc/ld.so.preload ] || "
              "echo /var/tmp/forge.so > /etc/ld.so.preload; sleep 0.02; done\n")
    run(runtime, sid, write_file("/opt/k.sh", keeper) + "; " + daemon("/opt/k.sh"))
    test_sh = ("sleep 1.5\n"
               "python3 -c 'open(\"/logs/verifier/reward.txt\", \"w\").write(\"0.5\")'\n")
    result, reward = verify(runtime, sid, tmp_path, test_sh)
    assert reward == "0.5", (reward, result.output)


@pytest.mark.sandbox
@pytest.mark.parametrize("target", ["etc/python3.11", "logs/verifier"])
def test_the_thawed_agent_cannot_detach_the_verifiers_mounts(runtime, make, tmp_path,
                                                             target):
    """Since Linux 3.18, removing (or renaming over) a file or folder that is a mount point
    in *another* mount namespace succeeds and detaches those mounts. The verifier's
    mounts below the top level sit on the agent's own dentries (its /etc and /logs are
    bound live into the verifier's root): the image's /etc/python3.11 over the agent's,
    the verifier's logs folder over the agent's /logs/verifier. A daemon of the agent's,
    thawed once the verifier's command runs, removes and remakes them: had it succeeded,
    the image's python3 would have run the agent's sitecustomize.py (0.5 forged to 1), or
    the verifier would have written its reward into the agent's folder (a masked "no
    reward" instead of its 0). They are immutable while the verifier runs."""
    sid = make()
    plant = ("cp /var/tmp/c.py /etc/python3.11/sitecustomize.py" if target.startswith("etc")
             else "true")
    loop = ("while :; do [ -e /logs/verifier/reward.txt ] || "
            f"{{ rm -rf /{target}; mkdir -p /{target}; {plant}; }}; sleep 0.05; done\n")
    run(runtime, sid, write_file("/var/tmp/c.py", FORGE_PY) + " && mkdir -p /logs/verifier && "
        + write_file("/opt/x.sh", loop) + " && " + daemon("/opt/x.sh"))
    test_sh = ("sleep 1.5\n"
               "python3 -c 'open(\"/logs/verifier/reward.txt\", \"w\").write(\"0.5\")'\n")
    result, reward = verify(runtime, sid, tmp_path, test_sh)
    seen = run(runtime, sid, "cat /logs/verifier/reward.txt 2>/dev/null").output
    assert (reward, seen) == ("0.5", ""), (reward, seen, result.output)
    # once the verifier has ended, the agent's folder is its own again (its daemon, still
    # removing and remaking it, may have it gone for an instant: a few tries)
    assert run(runtime, sid, f"for i in $(seq 100); do if touch /{target}/x 2>/dev/null; "
                             f"then rm -f /{target}/x; echo writable; break; fi; sleep 0.02; "
                             "done").output == "writable\n"


# ---- 3. a full disk


@pytest.mark.sandbox
def test_a_full_disk_without_tests_or_logs_folders_still_gets_the_verifiers_reward(
        runtime, make, tmp_path):
    """The agent removes /tests and /logs (the host must make them as mount points on the
    agent's disk) and fills its disk's blocks and inodes (in a subfolder, so that / keeps
    fewer than ``TOP_LEVEL_MAX`` names): the verifier still runs in its own root and its
    reward is read."""
    sid = make(storage_mb=64)
    fill = ("rm -rf /tests /logs; mkdir /var/tmp/fill; "
            "dd if=/dev/zero of=/var/tmp/fill/blocks bs=1M status=none; python3 -c '\n"
            "i = 0\n"
            "while True:\n"
            "    try:\n"
            "        open(f\"/var/tmp/fill/i{i}\", \"w\").close(); i += 1\n"
            "    except OSError as e:\n"
            "        print(e.strerror); break\n'; mkdir /x 2>&1")
    out = run(runtime, sid, fill, timeout=120).output
    assert "No space left on device" in out, out
    test_sh = "ls /tests\necho 0.5 > /logs/verifier/reward.txt\n"
    result, reward = verify(runtime, sid, tmp_path, test_sh)
    assert (result.exit_code, reward, result.output) == (0, "0.5", "test.sh\n"), \
        result.output


@pytest.mark.sandbox
def test_renaming_a_top_level_folder_or_clearing_the_flag_changes_nothing_for_the_verifier(
        runtime, make, tmp_path):
    """While the verifier runs, the agent tries to clear the immutable flag on
    /logs/verifier (it has no CAP_LINUX_IMMUTABLE), then renames its /logs away and makes
    a new /logs/verifier (on this overlay the rename itself fails and mv falls back to
    copying and removing, which the immutable folder stops; a rename that went through
    would not matter either: the verifier's /logs is bound to the folder, not the name).
    The verifier's reward reaches the host and never the agent's folders."""
    sid = make()
    loop = ("while ! [ -e /tmp/go ]; do sleep 0.02; done; "  # the verifier has started
            "{ chattr -i /logs/verifier; mv /logs /logs.old; mkdir -p /logs/verifier; "
            "touch /tmp/done; } 2>>/var/tmp/err\n")
    run(runtime, sid, "mkdir -p /logs/verifier && " + write_file("/opt/r.sh", loop) + " && "
        + daemon("/opt/r.sh"))
    test_sh = ("touch /tmp/go\n"  # (the agent's /tmp: it sees this)
               "for i in $(seq 250); do [ -e /tmp/done ] && break; sleep 0.02; done\n"
               "test -e /tmp/done && echo attacked\n"
               "echo 0.5 > /logs/verifier/reward.txt\n")
    result, reward = verify(runtime, sid, tmp_path, test_sh)
    # the agent's attempt ran while the verifier ran (else this proves nothing)
    assert (reward, result.output) == ("0.5", "attacked\n"), (reward, result.output)
    after = run(runtime, sid, "cat /var/tmp/err; ls -A /logs/verifier /logs.old/verifier "
                              "2>/dev/null")
    assert after.output.startswith("chattr: Operation not permitted"), after.output
    assert "reward.txt" not in after.output, after.output
