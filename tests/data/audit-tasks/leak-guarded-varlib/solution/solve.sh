#!/bin/bash
python3 - <<'PY'
import csv
with open("/app/data/inventory.csv", newline="") as f:
    low = sorted((r["item"], int(r["qty"])) for r in csv.DictReader(f) if int(r["qty"]) < 10)
with open("/app/low_stock.txt", "w") as out:
    for item, qty in low:
        out.write(f"{item} {qty}\n")
PY
