"""Check /app/sorted_fruit.txt against tests/expected.txt (blank lines ignored)."""
import os

REWARD = "/logs/verifier/reward.txt"


def norm(lines):
    return [line.strip() for line in lines if line.strip()]


want = norm(open("/tests/expected.txt").read().splitlines())
try:
    have = norm(open("/app/sorted_fruit.txt").read().splitlines())
except OSError as e:
    print("cannot read /app/sorted_fruit.txt:", e)
    have = []
print(f"{len(have)} lines, {len(want)} expected")
ok = want == norm(want)
print("PASS" if ok else "FAIL")
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write("1.0\n" if ok else "0.0\n")
