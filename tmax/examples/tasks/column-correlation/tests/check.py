"""Graded check of /app/correlation.json: reward = passed / 3 over
pair (exact, alphabetical), r (within 0.0005, sign included), strong_pairs (exact).
Missing or invalid file -> 0.
"""
import json
import os

EXPECTED_PAIR = ["tenure", "visits"]   # r = -0.9643 on environment/data/features.csv
EXPECTED_R = -0.9643
EXPECTED_STRONG = 4                    # |r| >= 0.5: tenure/visits, income/spend, age/income, age/spend
REWARD = "/logs/verifier/reward.txt"
reward = 0.0
try:
    got = json.load(open("/app/correlation.json"))
    assert isinstance(got, dict), "not an object"
    checks = [
        ("pair", got.get("pair") == EXPECTED_PAIR),
        ("r", isinstance(got.get("r"), (int, float)) and not isinstance(got.get("r"), bool)
         and abs(got["r"] - EXPECTED_R) <= 0.0005),
        ("strong_pairs", type(got.get("strong_pairs")) is int
         and got["strong_pairs"] == EXPECTED_STRONG),
    ]
    for name, ok in checks:
        print(("PASS " if ok else "FAIL ") + name, repr(got.get(name)))
    reward = sum(ok for _, ok in checks) / len(checks)
except Exception as e:
    print("cannot use /app/correlation.json:", e)
print("reward", round(reward, 4))
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write(f"{reward:.4f}\n")
