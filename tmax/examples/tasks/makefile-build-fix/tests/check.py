"""Graded check of the mathlib build. Works on a scratch copy of /app/proj.

Reward = passed / 6:
  1. `make clean` then `make test` exit 0
  2. hidden unit tests (tests/hidden_test_stats.py) pass against the built library
  3. `make dist` exits 0 and creates dist/mathlib-1.4.2.tar.gz
  4. the archive's files are exactly mathlib-1.4.2/mathlib/{__init__,_version,stats}.py
  5. _version.py in the archive sets __version__ = "1.4.2"
  6. after changing VERSION to 1.5.0, `make dist` builds dist/mathlib-1.5.0.tar.gz whose
     _version.py says 1.5.0
"""
import os
import shutil
import subprocess
import tarfile
import time

WORK = "/tmp/mathlib-check"
P = os.path.join(WORK, "proj")
REWARD = "/logs/verifier/reward.txt"


def sh(cmd, **kw):
    try:
        r = subprocess.run(cmd, cwd=P, capture_output=True, text=True, timeout=120, **kw)
    except Exception as e:
        print("  error:", e)
        return False
    if r.returncode != 0:
        print("  $", " ".join(cmd), "->", r.returncode, (r.stdout + r.stderr)[-600:])
    return r.returncode == 0


def members(path):
    try:
        with tarfile.open(path, "r:gz") as t:
            files = {m.name.lstrip("./"): m for m in t.getmembers() if m.isfile()}
            data = {n: t.extractfile(m).read() for n, m in files.items()}
        return data
    except Exception as e:
        print("  cannot read", path, e)
        return None


def version_of(src):
    ns = {}
    try:
        exec(compile(src, "_version.py", "exec"), ns)
    except Exception as e:
        print("  _version.py does not run:", e)
    return ns.get("__version__")


def main():
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    if not os.path.isdir("/app/proj"):
        return 0.0
    shutil.copytree("/app/proj", P, symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    checks = []
    checks.append(("make clean && make test", sh(["make", "clean"]) and sh(["make", "test"])))
    env = dict(os.environ, PYTHONPATH=os.path.join(P, "src"))
    shutil.copy("/tests/hidden_test_stats.py", os.path.join(WORK, "hidden_test_stats.py"))
    ok = False
    try:
        r = subprocess.run(["python3", "-m", "unittest", "-v", "hidden_test_stats"], cwd=WORK,
                           env=env, capture_output=True, text=True, timeout=120)
        ok = r.returncode == 0
        if not ok:
            print("  hidden tests:", r.stderr[-800:])
    except Exception as e:
        print("  hidden tests error:", e)
    checks.append(("hidden unit tests", ok))
    dist = os.path.join(P, "dist", "mathlib-1.4.2.tar.gz")
    checks.append(("make dist -> dist/mathlib-1.4.2.tar.gz", sh(["make", "dist"]) and os.path.isfile(dist)))
    data = members(dist) if os.path.isfile(dist) else None
    want = {f"mathlib-1.4.2/mathlib/{n}.py" for n in ("__init__", "_version", "stats")}
    if data is not None and set(data) != want:
        print("  archive files:", sorted(data))
    checks.append(("archive content", data is not None and set(data) == want))
    v = version_of(data.get("mathlib-1.4.2/mathlib/_version.py", b"")) if data else None
    checks.append(("archive _version.py == 1.4.2", v == "1.4.2"))
    ok = False
    try:
        # let the clock move on: .pyc files are validated by source mtime (seconds) + size
        time.sleep(1.1)
        with open(os.path.join(P, "VERSION"), "w") as f:
            f.write("1.5.0\n")
        dist2 = os.path.join(P, "dist", "mathlib-1.5.0.tar.gz")
        if sh(["make", "dist"]) and os.path.isfile(dist2):
            d2 = members(dist2) or {}
            ok = version_of(d2.get("mathlib-1.5.0/mathlib/_version.py", b"")) == "1.5.0"
    except Exception as e:
        print("  version bump error:", e)
    checks.append(("version bump rebuild", ok))
    for name, ok in checks:
        print(("PASS " if ok else "FAIL ") + name)
    shutil.rmtree(WORK, ignore_errors=True)
    return sum(bool(ok) for _, ok in checks) / len(checks)


try:
    reward = main()
except Exception as e:
    print("checker error:", e)
    reward = 0.0
print("reward", round(reward, 4))
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write(f"{reward:.4f}\n")
