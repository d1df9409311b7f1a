"""Binary check: /app/emails.txt equals tests/expected.txt (shipped with the verifier only)."""
import os

REWARD = "/logs/verifier/reward.txt"
ok = False
try:
    want = open("/tests/expected.txt").read().split()
    got = [l.strip() for l in open("/app/emails.txt").read().splitlines() if l.strip()]
    print(f"{len(got)} addresses, {len(want)} expected")
    ok = got == want
except OSError as e:
    print("cannot read:", e)
print("PASS" if ok else "FAIL")
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write("1.0\n" if ok else "0.0\n")
