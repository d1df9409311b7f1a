#!/bin/bash
python3 - <<'PY'
import csv
from decimal import Decimal
tot = {}
with open("/app/data/orders.csv", newline="") as f:
    for row in csv.DictReader(f):
        tot[row["customer"]] = tot.get(row["customer"], Decimal(0)) + Decimal(row["amount"])
with open("/app/customer_totals.txt", "w") as out:
    for c in sorted(tot):
        out.write(f"{c} {tot[c]:.2f}\n")
PY
