"""Binary check of the per-line word counts."""
import os

OUT = "/app/outputs/counts.txt"
EXPECTED = ['8', '7', '9', '9']
REWARD = "/logs/verifier/reward.txt"
ok = False
try:
    got = [l.strip() for l in open(OUT).read().splitlines() if l.strip()]
    print(got)
    ok = got == EXPECTED
except OSError as e:
    print("cannot read", OUT, e)
print("PASS" if ok else "FAIL")
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write("1.0\n" if ok else "0.0\n")
