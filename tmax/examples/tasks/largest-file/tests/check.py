"""Binary check: /app/answer.txt names the largest file under /app/files (as shipped)."""
import os

EXPECTED = "scan_0007.dat"  # 9876 bytes; runner-up is 9310 bytes
REWARD = "/logs/verifier/reward.txt"
ok = False
try:
    text = open("/app/answer.txt").read()
    print("answer:", repr(text[:120]))
    ok = text in (EXPECTED, EXPECTED + "\n")
except OSError as e:
    print("cannot read /app/answer.txt:", e)
print("PASS" if ok else "FAIL")
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write("1.0\n" if ok else "0.0\n")
