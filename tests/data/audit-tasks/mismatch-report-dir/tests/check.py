"""Binary check of the level report."""
import os

OUT = "/app/out/report.txt"
EXPECTED = ["ERROR 12", "WARN 10"]
REWARD = "/logs/verifier/reward.txt"
ok = False
try:
    got = [l.strip() for l in open(OUT).read().splitlines() if l.strip()]
    print("report:", got)
    ok = got == EXPECTED
except OSError as e:
    print("cannot read", OUT, e)
print("PASS" if ok else "FAIL")
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write("1.0\n" if ok else "0.0\n")
