"""Check /app/out.txt against the word counts of data/text.txt."""
import os

EXPECTED = 'the 9\ndog 4\nfox 4\n'
REWARD = "/logs/verifier/reward.txt"
ok = False
try:
    got = open("/app/out.txt").read()
    print("out.txt:", repr(got[:200]))
    ok = got.rstrip("\n") == EXPECTED.rstrip("\n")
except OSError as e:
    print("cannot read /app/out.txt:", e)
print("PASS" if ok else "FAIL")
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write("1.0\n" if ok else "0.0\n")
