"""Binary check: run the agent's /app/roman.py on the cases in tests/cases.txt."""
import os
import subprocess

REWARD = "/logs/verifier/reward.txt"
ok = False
try:
    cases = [line.split() for line in open("/tests/cases.txt") if line.strip()]
    good = 0
    for n, want in cases:
        p = subprocess.run(["python3", "/app/roman.py", n], capture_output=True, text=True, timeout=5)
        got = p.stdout.strip()
        good += got == want
        print("PASS" if got == want else "FAIL", n, repr(got), "expected", want)
    ok = good == len(cases)
except (OSError, subprocess.TimeoutExpired) as e:
    print("error:", e)
print("PASS" if ok else "FAIL")
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write("1.0\n" if ok else "0.0\n")
