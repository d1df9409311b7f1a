"""Binary check: /app/answer.txt holds the row count of orders in the database as built."""
import os

EXPECTED = 612  # rows inserted into orders by build_db.py (fixed seed)
REWARD = "/logs/verifier/reward.txt"
ok = False
try:
    text = open("/app/answer.txt").read()
    print("answer:", repr(text[:80]))
    ok = text in (str(EXPECTED), str(EXPECTED) + "\n")
except OSError as e:
    print("cannot read /app/answer.txt:", e)
print("PASS" if ok else "FAIL")
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write("1.0\n" if ok else "0.0\n")
