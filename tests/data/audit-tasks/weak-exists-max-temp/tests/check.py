"""Check that /app/max_temp.txt was produced."""
import os

REWARD = "/logs/verifier/reward.txt"
ok = os.path.exists("/app/max_temp.txt")
print("/app/max_temp.txt exists:", ok)
print("PASS" if ok else "FAIL")
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write("1.0\n" if ok else "0.0\n")
