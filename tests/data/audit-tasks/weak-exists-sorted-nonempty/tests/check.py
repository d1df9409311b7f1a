"""Check /app/sorted_numbers.txt: it must be there and not empty."""
import os

OUT = "/app/sorted_numbers.txt"
REWARD = "/logs/verifier/reward.txt"
ok = False
try:
    size = os.path.getsize(OUT)
    print(OUT, "size", size)
    ok = size > 0
except OSError as e:
    print("missing:", e)
print("PASS" if ok else "FAIL")
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write("1.0\n" if ok else "0.0\n")
