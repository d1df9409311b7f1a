"""Binary check: /app/line_count.txt holds the number of lines of data/events.log."""
import os

EXPECTED = 47
REWARD = "/logs/verifier/reward.txt"
ok = False
try:
    got = open("/app/line_count.txt").read().strip()
    print("got", repr(got), "expected", EXPECTED)
    ok = got == str(EXPECTED)
except OSError as e:
    print("cannot read /app/line_count.txt:", e)
print("PASS" if ok else "FAIL")
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write("1.0\n" if ok else "0.0\n")
