"""Graded permission audit of /app/srv.

Gate: every original file must still exist with unchanged content and nothing may be
added, otherwise 0. Reward = passed / 3 over the three rules of the instruction; rule 3
requires the exact original mode minus o+w for every entry outside rules 1-2.
"""
import hashlib
import os
import stat

ROOT = "/app/srv"
# original modes as set by the Dockerfile
ORIG = {
    ".": 0o755, "scripts": 0o755, "scripts/lib": 0o755, "conf": 0o755, "data": 0o755,
    "www": 0o755, "www/uploads": 0o777, "secrets": 0o755, "secrets/tls": 0o775,
    "scripts/backup.sh": 0o644, "scripts/rotate.sh": 0o777, "scripts/lib/common.sh": 0o664,
    "scripts/README.txt": 0o666, "secrets/db.password": 0o644, "secrets/api.token": 0o666,
    "secrets/tls/server.key": 0o640, "www/index.html": 0o646, "www/style.css": 0o644,
    "www/uploads/.keep": 0o666, "conf/app.conf": 0o662, "data/report.csv": 0o640,
}
SHA = {
    "conf/app.conf": "27e4577db47c652f781c7ea7ea4a5b7d19351b657e5cf831d11a5eac30940d10",
    "data/report.csv": "a3a7c5eadb86466abad694ce37b8d3e55d2c85e78f2f6d91c6a866f3ff6dfdde",
    "scripts/README.txt": "4654f647ac7d6a298dd6654a3825d2cafd8dbe354d199c91e990b6041e561f5d",
    "scripts/backup.sh": "5d9fcb4130ba38e243ee0818b180669367c6b7b8ce5c01b38a16852c40c07ce8",
    "scripts/lib/common.sh": "8d6db9bdd387fd3c99d3653def316988a5b9daba204a8368868597c9de891158",
    "scripts/rotate.sh": "19ab0b624c201771ba3ed427271fca6d4883fb505dd3c0fb65a8ce23fe69eaf9",
    "secrets/api.token": "e531f24daec3c971c726c7aee2b9f6177f507529791c9c75bc89105a93cd089e",
    "secrets/db.password": "c7581db0e578924304672c58958e60200857a0f2d8ed556768a43b8bd09b033f",
    "secrets/tls/server.key": "286e0d75b8451bc338c735629bc6e4f4953f353fa0385b294386cb4856924df3",
    "www/index.html": "f530929641d2e44704738aa581f6f62d18a652854c75fbbca67c1d92a9f35977",
    "www/style.css": "b4d5deb2f19a59cc8683e443244245fad7c2e9a22e20b02dc2068698c69a9528",
    "www/uploads/.keep": "2f73349cfc4630255319c6c8dfc1b46a8996ace9d14d8e07563b165915918ec2",
}
REWARD = "/logs/verifier/reward.txt"


def mode(rel):
    return stat.S_IMODE(os.lstat(os.path.join(ROOT, rel)).st_mode)


def main():
    present = set()
    for dp, dn, fn in os.walk(ROOT):
        for n in dn + fn:
            present.add(os.path.relpath(os.path.join(dp, n), ROOT))
    present.add(".")
    if present != set(ORIG):
        print("FAIL gate: entries added/removed:", sorted(present ^ set(ORIG)))
        return 0.0
    for rel, digest in SHA.items():
        with open(os.path.join(ROOT, rel), "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() != digest:
                print("FAIL gate: content changed:", rel)
                return 0.0
    rule1 = [r for r in ORIG if r.startswith("scripts/") and r.endswith(".sh")]
    rule2 = [r for r in ORIG if r == "secrets" or r.startswith("secrets/")]
    rest = [r for r in ORIG if r not in rule1 and r not in rule2]
    bad1 = [r for r in rule1 if mode(r) != 0o750]
    bad2 = [r for r in rule2
            if mode(r) != (0o700 if os.path.isdir(os.path.join(ROOT, r)) else 0o600)]
    bad3 = [r for r in rest if mode(r) != ORIG[r] & ~0o002]
    passed = 0
    for name, bad in (("rule 1 (.sh = 0750)", bad1), ("rule 2 (secrets 0700/0600)", bad2),
                      ("rule 3 (only o-w removed elsewhere)", bad3)):
        print(("PASS " if not bad else "FAIL ") + name,
              "" if not bad else [f"{r}={oct(mode(r))}" for r in bad])
        passed += not bad
    return passed / 3


try:
    reward = main()
except Exception as e:
    print("error:", e)
    reward = 0.0
print("reward", reward)
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write(f"{reward}\n")
