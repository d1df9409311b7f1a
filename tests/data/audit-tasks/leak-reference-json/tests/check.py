"""Binary check: /app/totals.json holds the same object as the reference in the image."""
import json
import os

OUT = "/app/totals.json"
REFERENCE = "/app/reference/totals.json"
REWARD = "/logs/verifier/reward.txt"
ok = False
try:
    got, want = json.load(open(OUT)), json.load(open(REFERENCE))
    ok = set(got) == set(want) and all(
        got[k]["orders"] == want[k]["orders"] and abs(got[k]["total"] - want[k]["total"]) < 0.005
        for k in want)
except (OSError, ValueError, KeyError, TypeError) as e:
    print("cannot compare:", e)
print("PASS" if ok else "FAIL")
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write("1.0\n" if ok else "0.0\n")
