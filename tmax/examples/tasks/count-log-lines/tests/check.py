"""Binary check: /app/answer.txt holds the line count of the original access.log."""
import os

EXPECTED = 437  # line count of environment/data/access.log as shipped
REWARD = "/logs/verifier/reward.txt"
ok = False
try:
    text = open("/app/answer.txt").read()
    print("answer:", repr(text[:80]))
    ok = text.strip() == str(EXPECTED) and text in (str(EXPECTED), str(EXPECTED) + "\n")
except OSError as e:
    print("cannot read /app/answer.txt:", e)
print("PASS" if ok else f"FAIL (expected {EXPECTED})")
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write("1.0\n" if ok else "0.0\n")
