"""Graded check of /app/predictions.csv against the reference k-NN predictions
(tests/expected_predictions.csv, computed with the exact procedure of the instruction).

acc = fraction of test ids whose predicted label matches the reference (rows are matched by
id; missing, duplicate or unknown ids count as wrong). A constant answer already agrees on
the share b of the most frequent reference label, so the reward is the agreement above that
baseline: max(0, (acc - b) / (1 - b)); 1.0 for a perfect answer, 0 for any constant answer.
"""
import csv
import os

REWARD = "/logs/verifier/reward.txt"
expected = {r["id"]: r["label"] for r in csv.DictReader(open("/tests/expected_predictions.csv"))}
counts = {}
for lab in expected.values():
    counts[lab] = counts.get(lab, 0) + 1
baseline = max(counts.values()) / len(expected)
reward = 0.0
try:
    with open("/app/predictions.csv", newline="") as f:
        rows = list(csv.reader(f))
    if not rows or [c.strip() for c in rows[0]] != ["id", "label"]:
        raise ValueError(f"bad header {rows[:1]}")
    got, dup = {}, set()
    for row in rows[1:]:
        if len(row) != 2:
            continue
        i, lab = row[0].strip(), row[1].strip()
        if i in got:
            dup.add(i)
        got[i] = lab
    correct = sum(1 for i, lab in expected.items() if i not in dup and got.get(i) == lab)
    acc = correct / len(expected)
    print(f"agreement {correct}/{len(expected)}; duplicates {len(dup)}; "
          f"unknown ids {len(set(got) - set(expected))}")
    reward = max(0.0, (acc - baseline) / (1 - baseline))
except Exception as e:
    print("cannot use /app/predictions.csv:", e)
print("reward", round(reward, 4))
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write(f"{reward:.4f}\n")
