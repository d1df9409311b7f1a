"""Graded check: run the agent's /app/report.py on 4 hidden event files.

Reward = (number of files whose stdout parses to exactly the expected JSON) / 4.
Every hidden file contains blank lines and null/missing durations, so the original
script fails on all of them.
"""
import glob
import json
import os
import subprocess

REWARD = "/logs/verifier/reward.txt"
cases = sorted(glob.glob("/tests/cases/case*.jsonl"))
good = 0
for path in cases:
    expected = json.load(open(path.replace(".jsonl", ".expected.json")))
    try:
        out = subprocess.run(["python3", "/app/report.py", path], capture_output=True,
                             text=True, timeout=30)
        got = json.loads(out.stdout)
        ok = got == expected and isinstance(got.get("error_rate"), float)
        msg = "" if ok else f"got {out.stdout[:300]!r} stderr {out.stderr[-300:]!r}"
    except Exception as e:
        ok, msg = False, f"error: {e}"
    print(("PASS " if ok else "FAIL ") + os.path.basename(path), msg)
    good += ok
reward = good / len(cases) if cases else 0.0
print("reward", reward)
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write(f"{reward}\n")
