"""Graded check: each hidden case in tests/hidden_cases.py runs in its own interpreter
(so state leaking between calls inside one process is exercised by the cases themselves,
not by the harness). Reward = passed cases / number of cases.
"""
import json
import os
import subprocess

CASES = ["case_parse_crlf", "case_parse_spaces", "case_apply_repeatable",
         "case_apply_opening_untouched", "case_cli_crlf_three_warehouses",
         "case_cli_spaces_two_warehouses"]
REWARD = "/logs/verifier/reward.txt"
good = 0
for name in CASES:
    try:
        out = subprocess.run(["python3", "/tests/hidden_cases.py", name], capture_output=True,
                             text=True, timeout=60, cwd="/tmp")
        ok = json.loads(out.stdout.strip().splitlines()[-1]).get(name) is True
        err = out.stderr.strip().splitlines()[-1:] if not ok else []
    except Exception as e:
        ok, err = False, [str(e)]
    print(("PASS " if ok else "FAIL ") + name, *err)
    good += ok
reward = good / len(CASES)
print("reward", round(reward, 4))
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write(f"{reward:.4f}\n")
