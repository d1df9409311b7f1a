"""Binary check: /app/unique_names.txt equals tests/expected.txt (trailing blank lines ignored)."""
import os

OUT = "/app/unique_names.txt"
EXPECTED = "/tests/expected.txt"
REWARD = "/logs/verifier/reward.txt"
ok = False
try:
    want = open(EXPECTED).read().splitlines()
    got = [l.rstrip("\r") for l in open(OUT).read().splitlines()]
    while got and not got[-1].strip():
        got.pop()
    ok = got == want
    print(f"{len(got)} lines, {len(want)} expected")
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            print(f"first difference at line {i + 1}: got {g!r} expected {w!r}")
            break
except OSError as e:
    print("cannot read:", e)
print("PASS" if ok else "FAIL")
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write("1.0\n" if ok else "0.0\n")
