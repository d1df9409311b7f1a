"""Graded check of /app/top_customers.csv.

Reward = (number of the 5 data rows that are exactly right, at the right position) / 5,
and 0 if the file is missing or its header is wrong.
"""
import os

EXPECTED = [  # completed orders in 2023, database built by build_db.py (fixed seed)
    "Femi Moreau,9017.89",
    "Sven Fischer,7247.41",
    "Tara Alvarez,7139.32",
    "Luca Becker,7098.32",
    "Maya Okafor,6532.19",
]
REWARD = "/logs/verifier/reward.txt"
reward = 0.0
try:
    lines = open("/app/top_customers.csv").read().splitlines()
    lines = [l.rstrip("\r") for l in lines]
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines or lines[0].strip() != "customer_name,total_spend":
        print("FAIL header:", repr(lines[:1]))
    else:
        rows = lines[1:]
        good = 0
        for i, exp in enumerate(EXPECTED):
            got = rows[i].strip() if i < len(rows) else None
            ok = got == exp
            good += ok
            print(("PASS" if ok else "FAIL"), f"row {i + 1}: got {got!r} expected {exp!r}")
        if len(rows) != len(EXPECTED):
            print(f"FAIL: {len(rows)} data rows instead of {len(EXPECTED)}")
            good = max(0, good - abs(len(rows) - len(EXPECTED)))
        reward = good / len(EXPECTED)
except OSError as e:
    print("cannot read /app/top_customers.csv:", e)
print("reward", reward)
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write(f"{reward}\n")
