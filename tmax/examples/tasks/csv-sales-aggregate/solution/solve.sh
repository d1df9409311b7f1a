#!/bin/bash
python3 - <<'PY'
import csv
from decimal import Decimal

totals = {}
with open("/app/data/sales.csv", newline="") as f:
    for row in csv.DictReader(f):
        t = totals.setdefault(row["region"], [0, Decimal(0)])
        t[0] += int(row["units"])
        t[1] += int(row["units"]) * Decimal(row["unit_price"])
with open("/app/summary.csv", "w") as out:
    out.write("region,total_units,total_revenue\n")
    for region in sorted(totals):
        units, revenue = totals[region]
        out.write(f"{region},{units},{revenue:.2f}\n")
PY
