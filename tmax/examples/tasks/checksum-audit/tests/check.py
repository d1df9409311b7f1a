"""Graded check of /app/tampered.txt.

Reward = Jaccard index between the listed paths and the files that really fail
verification; a missing or empty file gives 0.
"""
import os

EXPECTED = {"bin/helper.sh", "etc/defaults.conf", "lib/libnet.so.1", "share/data/table.dat"}
REWARD = "/logs/verifier/reward.txt"
reward = 0.0
try:
    listed = {l.strip() for l in open("/app/tampered.txt", errors="replace") if l.strip()}
    listed = {l.removeprefix("./") for l in listed}
    hit, union = EXPECTED & listed, EXPECTED | listed
    print("correct:", sorted(hit))
    print("missed:", sorted(EXPECTED - listed))
    print("wrong:", sorted(listed - EXPECTED)[:10])
    reward = len(hit) / len(union) if union else 0.0
except OSError as e:
    print("cannot read /app/tampered.txt:", e)
print("reward", round(reward, 4))
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write(f"{reward:.4f}\n")
