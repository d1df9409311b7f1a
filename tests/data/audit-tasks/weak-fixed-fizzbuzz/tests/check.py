"""Check /app/out.txt against FizzBuzz up to 20."""
import os

EXPECTED = '1\n2\nFizz\n4\nBuzz\nFizz\n7\n8\nFizz\nBuzz\n11\nFizz\n13\n14\nFizzBuzz\n16\n17\nFizz\n19\nBuzz\n'
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
