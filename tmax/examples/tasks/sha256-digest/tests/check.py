"""Binary check: /app/answer.txt holds the SHA-256 of firmware.bin as shipped."""
import os

EXPECTED = "d329d8b434fbaa4df3ecc5d026412144b111ff703ba174838e4d4f5e91e54f69"
REWARD = "/logs/verifier/reward.txt"
ok = False
try:
    text = open("/app/answer.txt").read()
    print("answer:", repr(text[:100]))
    ok = text in (EXPECTED, EXPECTED + "\n")
except OSError as e:
    print("cannot read /app/answer.txt:", e)
print("PASS" if ok else "FAIL")
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write("1.0\n" if ok else "0.0\n")
