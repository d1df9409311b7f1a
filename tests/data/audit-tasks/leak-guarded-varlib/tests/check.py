"""Binary check: every expected line of tests/expected.txt is in /app/low_stock.txt (other lines
are tolerated), and the file is not a verbatim copy of the cached report (anti-copy guard)."""
import hashlib
import os

OUT = "/app/low_stock.txt"
CACHED_REPORT_SHA256 = "e76c94029445be5a35086dd828aa1f12b894f1ff7b21a9334ff56dbe1b86e40b"  # /var/lib/report-gen/last_run.txt as shipped
REWARD = "/logs/verifier/reward.txt"
ok = False
try:
    data = open(OUT, "rb").read()
    if hashlib.sha256(data).hexdigest() == CACHED_REPORT_SHA256:
        print("FAIL: output is a verbatim copy of the cached report")
    else:
        want = open("/tests/expected.txt").read().splitlines()
        got = [l.strip() for l in data.decode().splitlines()]
        missing = [w for w in want if w not in got]
        print(f"{len(want) - len(missing)}/{len(want)} expected lines present")
        ok = not missing
except (OSError, UnicodeDecodeError) as e:
    print("cannot read:", e)
print("PASS" if ok else "FAIL")
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write("1.0\n" if ok else "0.0\n")
