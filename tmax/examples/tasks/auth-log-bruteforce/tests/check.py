"""Graded check of /app/blocklist.txt.

Reward = |expected & listed| / |expected | listed| (Jaccard index of the IP sets): every
missed offender and every wrongly listed address lowers it; a missing/empty file gives 0.
"""
import os
import re

EXPECTED = {  # IPs with >= 5 "Failed password for" lines in environment/var/log/auth.log
    "45.33.12.8", "203.0.113.5", "185.220.101.4", "203.0.113.50", "198.51.100.23",
}
REWARD = "/logs/verifier/reward.txt"
reward = 0.0
try:
    listed = set()
    for line in open("/app/blocklist.txt", errors="replace"):
        line = line.strip()
        if line:
            listed.add(line)
    bad = {x for x in listed if not re.fullmatch(r"\d{1,3}(\.\d{1,3}){3}", x)}
    if bad:
        print("lines that are not a bare IPv4 address:", sorted(bad)[:5])
    hit, union = EXPECTED & listed, EXPECTED | listed
    print("correct:", sorted(hit))
    print("missed:", sorted(EXPECTED - listed))
    print("wrongly listed:", sorted(listed - EXPECTED)[:10])
    reward = len(hit) / len(union) if union else 0.0
except OSError as e:
    print("cannot read /app/blocklist.txt:", e)
print("reward", round(reward, 4))
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write(f"{reward:.4f}\n")
