#!/bin/bash
python3 - <<'PY'
import csv
import json
from decimal import Decimal
tot = {}
with open("/app/data/orders.csv", newline="") as f:
    for row in csv.DictReader(f):
        c = tot.setdefault(row["customer"], {"orders": 0, "total": Decimal(0)})
        c["orders"] += 1
        c["total"] += Decimal(row["amount"])
with open("/app/totals.json", "w") as out:
    json.dump({k: {"orders": v["orders"], "total": float(round(v["total"], 2))}
               for k, v in sorted(tot.items())}, out)
PY
