#!/bin/bash
python3 - <<'PY'
import csv
from decimal import Decimal
best = {}
with open("/app/data/readings.csv", newline="") as f:
    for row in csv.DictReader(f):
        v = Decimal(row["value"])
        best[row["sensor"]] = max(best.get(row["sensor"], v), v)
with open("/app/sensor_max.txt", "w") as out:
    for s in sorted(best):
        out.write(f"{s} {best[s]:.2f}\n")
PY
