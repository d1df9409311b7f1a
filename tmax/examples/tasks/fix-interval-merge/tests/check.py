"""Graded check: reward = fraction of hidden test cases (tests/hidden_cases.py) that pass
against the agent's /app/intervals package. Runs in a subprocess with a timeout.
"""
import json
import os
import subprocess

REWARD = "/logs/verifier/reward.txt"
reward = 0.0
try:
    out = subprocess.run(["python3", "/tests/hidden_cases.py"], capture_output=True,
                         text=True, timeout=60, cwd="/tmp")
    results = json.loads(out.stdout.strip().splitlines()[-1])
    for name, ok in sorted(results.items()):
        print(("PASS " if ok else "FAIL ") + name)
    reward = sum(results.values()) / len(results)
except Exception as e:
    print("hidden tests could not run:", e)
print("reward", round(reward, 4))
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write(f"{reward:.4f}\n")
