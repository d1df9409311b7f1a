"""Graded check of /app/stats.json.

Reward = (number of sensors whose five statistics are all correct) / 4. Counts must match
exactly, floats within 0.002 (allows for rounding differences). Missing/invalid file -> 0.
"""
import json
import os

EXPECTED = {  # computed from environment/data/readings.csv (valid readings only, Celsius)
    "S1": {"count": 68, "mean_c": 20.165, "std_c": 1.422, "min_c": 17.722, "max_c": 24.389},
    "S2": {"count": 69, "mean_c": 4.585, "std_c": 3.234, "min_c": -1.556, "max_c": 12.722},
    "S3": {"count": 71, "mean_c": 35.397, "std_c": 0.67, "min_c": 33.833, "max_c": 36.833},
    "S4": {"count": 72, "mean_c": 15.389, "std_c": 5.418, "min_c": 6.0, "max_c": 27.5},
}
TOL = 0.002
REWARD = "/logs/verifier/reward.txt"


def num(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


reward = 0.0
try:
    got = json.load(open("/app/stats.json"))
    good = 0
    for s, exp in EXPECTED.items():
        g = got.get(s) if isinstance(got, dict) else None
        errs = []
        if not isinstance(g, dict):
            errs.append("missing")
        else:
            for k, v in exp.items():
                x = g.get(k)
                if k == "count":
                    ok = num(x) and x == v
                else:
                    ok = num(x) and abs(x - v) <= TOL
                if not ok:
                    errs.append(f"{k}={x!r} (expected {v})")
        print(("PASS " if not errs else "FAIL ") + s, "; ".join(errs))
        good += not errs
    reward = good / len(EXPECTED)
except Exception as e:
    print("cannot read /app/stats.json:", e)
print("reward", reward)
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write(f"{reward}\n")
