"""Graded check of /app/bin/rotate_logs.sh and /app/etc/cron.d/logrotate.

The script is run on fresh fixture directories under /tmp. Reward = passed / 8:
  1. script is executable and exits 0 on the fixture
  2. big.log rotated: archives shifted (.1->.2, .2->.3, old .3 dropped), new .1.gz holds the
     old content, big.log truncated in place (same inode, checked through a descriptor
     held open during the run)
  3. mid.log (only a .1.gz before) rotated correctly, no .3.gz invented
  4. "my app.log" (space in the name) rotated correctly
  5. nothing else touched: 1024-byte log and its archive, small/empty logs, non-.log files,
     subdirectory; no extra files created
  6. second run after new writes rotates again correctly and leaves the now-empty logs alone
  7. empty directory: exit 0 and nothing created
  8. cron entry "15 3 * * * root /app/bin/rotate_logs.sh /app/var/log" (and nothing else)
"""
import gzip
import os
import random
import shutil
import subprocess

SCRIPT = "/app/bin/rotate_logs.sh"
CRON = "/app/etc/cron.d/logrotate"
REWARD = "/logs/verifier/reward.txt"
BASE = "/tmp/rotate-check"
rnd = random.Random(17)


def text(n, tag):
    lines, size = [], 0
    while size < n:
        line = f"{tag} line {len(lines):05d} value={rnd.randint(0, 10**6)}\n"
        lines.append(line)
        size += len(line)
    return "".join(lines)[:n].encode()


def put(path, data, gz=False):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(gzip.compress(data) if gz else data)


def get(path, gz=False):
    try:
        with open(path, "rb") as f:
            data = f.read()
        return gzip.decompress(data) if gz else data
    except Exception:
        return None


def run(d):
    if os.access(SCRIPT, os.X_OK):
        cmd = [SCRIPT, d]
    elif os.path.isfile(SCRIPT):
        cmd = ["bash", SCRIPT, d]
    else:
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).returncode
    except Exception as e:
        print("run error:", e)
        return None


def listing(d):
    out = set()
    for dp, dn, fn in os.walk(d):
        for n in fn:
            out.add(os.path.relpath(os.path.join(dp, n), d))
    return out


def main():
    shutil.rmtree(BASE, ignore_errors=True)
    d = os.path.join(BASE, "logs")
    A, B1, B2, B3 = text(3000, "big"), text(900, "b1"), text(800, "b2"), text(700, "b3")
    C, C1 = text(2000, "mid"), text(600, "c1")
    S = text(1500, "spaced")
    E, E1 = text(1024, "edge"), text(500, "e1")
    other = {"small.log": text(10, "s"), "empty.log": b"", "notes.txt": text(5000, "n"),
             "data.log.bak": text(5000, "bak"), "sub/deep.log": text(5000, "deep")}
    put(f"{d}/big.log", A)
    put(f"{d}/big.log.1.gz", B1, True)
    put(f"{d}/big.log.2.gz", B2, True)
    put(f"{d}/big.log.3.gz", B3, True)
    put(f"{d}/mid.log", C)
    put(f"{d}/mid.log.1.gz", C1, True)
    put(f"{d}/my app.log", S)
    put(f"{d}/edge.log", E)
    put(f"{d}/edge.log.1.gz", E1, True)
    edge_gz = get(f"{d}/edge.log.1.gz")
    for k, v in other.items():
        put(f"{d}/{k}", v)
    # keep the logs open like the writing service does: a rotation that deletes or replaces
    # the file instead of truncating it in place leaves these descriptors on an unlinked inode
    fds = {n: open(f"{d}/{n}", "ab") for n in ("big.log", "mid.log", "my app.log")}
    expected_files = listing(d) | {"mid.log.2.gz", "my app.log.1.gz"}

    checks = []
    rc = run(d)
    checks.append(("script executable, exit 0", os.access(SCRIPT, os.X_OK) and rc == 0))

    def rotated(name, new1, new2, new3):
        p = f"{d}/{name}"
        st = os.fstat(fds[name].fileno())
        ok = (os.path.isfile(p) and os.path.getsize(p) == 0 and st.st_nlink > 0
              and os.stat(p).st_ino == st.st_ino and os.stat(p).st_dev == st.st_dev)
        ok = ok and get(p + ".1.gz", True) == new1
        ok = ok and (get(p + ".2.gz", True) == new2 if new2 is not None
                     else not os.path.exists(p + ".2.gz"))
        ok = ok and (get(p + ".3.gz", True) == new3 if new3 is not None
                     else not os.path.exists(p + ".3.gz"))
        return ok

    checks.append(("big.log rotated and shifted", rotated("big.log", A, B1, B2)))
    checks.append(("mid.log rotated", rotated("mid.log", C, C1, None)))
    checks.append(("'my app.log' rotated", rotated("my app.log", S, None, None)))
    untouched = (get(f"{d}/edge.log") == E and get(f"{d}/edge.log.1.gz") == edge_gz
                 and all(get(f"{d}/{k}") == v for k, v in other.items())
                 and listing(d) == expected_files)
    if not untouched:
        print("  files now:", sorted(listing(d)))
    checks.append(("other files untouched, nothing extra", untouched))

    A2 = text(2000, "big2")
    fds["big.log"].write(A2)  # the service keeps writing through its open descriptor
    fds["big.log"].flush()
    rc2 = run(d)
    ok = rc2 == 0 and rotated("big.log", A2, A, B1)
    ok = ok and get(f"{d}/mid.log.1.gz", True) == C and get(f"{d}/mid.log.2.gz", True) == C1
    ok = ok and get(f"{d}/my app.log.1.gz", True) == S
    checks.append(("second run", ok))

    empty = os.path.join(BASE, "empty")
    os.makedirs(empty)
    rc3 = run(empty)
    checks.append(("empty directory", rc3 == 0 and listing(empty) == set()))

    try:
        entries = [l.split() for l in open(CRON) if l.strip() and not l.lstrip().startswith("#")]
    except OSError:
        entries = []
    checks.append(("cron entry", entries == [["15", "3", "*", "*", "*", "root",
                                              "/app/bin/rotate_logs.sh", "/app/var/log"]]))
    for name, ok in checks:
        print(("PASS " if ok else "FAIL ") + name)
    for f in fds.values():
        f.close()
    shutil.rmtree(BASE, ignore_errors=True)
    return sum(bool(ok) for _, ok in checks) / len(checks)


try:
    reward = main()
except Exception as e:
    print("checker error:", e)
    reward = 0.0
print("reward", reward)
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write(f"{reward}\n")
