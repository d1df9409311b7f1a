"""Graded check of /app/summary.csv.

Reward = (number of correct region rows, in the correct order) / 5, and 0 if the file is
missing or the header is wrong. Extra rows cost one correct row each.
"""
import os

EXPECTED = [  # computed from environment/data/sales.csv with exact decimal arithmetic
    "Central,1161,10940.99",
    "East,1193,9918.91",
    "North,844,6979.92",
    "South,1080,10961.89",
    "West,999,11518.86",
]
REWARD = "/logs/verifier/reward.txt"
reward = 0.0
try:
    lines = [l.rstrip("\r") for l in open("/app/summary.csv").read().splitlines()]
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines or lines[0] != "region,total_units,total_revenue":
        print("FAIL header:", repr(lines[:1]))
    else:
        rows = lines[1:]
        good = 0
        for i, exp in enumerate(EXPECTED):
            got = rows[i] if i < len(rows) else None
            ok = got == exp
            good += ok
            print(("PASS" if ok else "FAIL"), f"row {i + 1}: got {got!r} expected {exp!r}")
        if len(rows) > len(EXPECTED):
            print(f"FAIL: {len(rows) - len(EXPECTED)} extra rows")
            good = max(0, good - (len(rows) - len(EXPECTED)))
        reward = good / len(EXPECTED)
except OSError as e:
    print("cannot read /app/summary.csv:", e)
print("reward", reward)
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write(f"{reward}\n")
