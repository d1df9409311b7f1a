#!/bin/bash
# Reference fix: parse with csv, subtract refunds, exact cents, ties by name.
set -euo pipefail
cat > /srv/shop/report.py <<'PY'
#!/usr/bin/env python3
"""Per-customer sales totals from an orders CSV export.

Usage: report.py ORDERS.csv

Prints one line per customer, "<customer>\t<total>", highest total first, ties by name.
"""

import csv
import sys
from decimal import Decimal

SIGN = {"paid": 1, "refunded": -1}


def main(path):
    totals = {}
    with open(path, encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            sign = SIGN.get(row["status"])
            if sign is None:
                continue
            cents = int(Decimal(row["unit_price"]) * 100)
            totals[row["customer"]] = totals.get(row["customer"], 0) + sign * int(row["quantity"]) * cents
    for customer, cents in sorted(totals.items(), key=lambda kv: (-kv[1], kv[0])):
        sign = "-" if cents < 0 else ""
        print(f"{customer}\t{sign}{abs(cents) // 100}.{abs(cents) % 100:02d}")


if __name__ == "__main__":
    main(sys.argv[1])
PY
python3 /srv/shop/report.py /srv/shop/data/orders.csv | head -n 3
