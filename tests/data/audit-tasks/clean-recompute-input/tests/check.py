"""Binary check: /app/sensor_max.txt holds the per-sensor maxima, recomputed here from
/app/data/readings.csv (which must be the file as shipped)."""
import csv
import hashlib
import os
from decimal import Decimal

INPUT = "/app/data/readings.csv"
INPUT_SHA256 = "f4eaf9249bf9b9b4789dc5e230cd8fcb442b89ccb28be57026c177c0ffd03dd6"  # environment/data/readings.csv as shipped
REWARD = "/logs/verifier/reward.txt"
ok = False
try:
    if hashlib.sha256(open(INPUT, "rb").read()).hexdigest() != INPUT_SHA256:
        print("FAIL: the input file was modified")
    else:
        best = {}
        with open(INPUT, newline="") as f:
            for row in csv.DictReader(f):
                v = Decimal(row["value"])
                if row["sensor"] not in best or v > best[row["sensor"]]:
                    best[row["sensor"]] = v
        want = [f"{s} {best[s]:.2f}" for s in sorted(best)]
        got = [l.strip() for l in open("/app/sensor_max.txt").read().splitlines() if l.strip()]
        print("got", got, "expected", want)
        ok = got == want
except OSError as e:
    print("cannot read:", e)
print("PASS" if ok else "FAIL")
os.makedirs(os.path.dirname(REWARD), exist_ok=True)
with open(REWARD, "w") as f:
    f.write("1.0\n" if ok else "0.0\n")
