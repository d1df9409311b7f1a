"""Binary check: /app/config.ini equals tests/expected.ini (trailing whitespace ignored)."""
import os

REWARD = "/logs/verifier/reward.txt"
ok = False
try:
    want = [l.rstrip() for l in open("/tests/expected.ini").read().rstrip("\n").splitlines()]
    got = [l.rstrip() for l in open("/app/config.ini").read().rstrip("\n").splitlines()]
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            print(f"line {i + 1}: got {g!r} expected {w!r}")
    ok = got == want
    print(f"{len(got)} lines, {len(want)} expected")
except OSError as e:
    print("cannot read:", e)
print("PASS" if ok else "FAIL")
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write("1.0\n" if ok else "0.0\n")
