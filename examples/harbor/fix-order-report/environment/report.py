#!/usr/bin/env python3
"""Per-customer sales totals from an orders CSV export.

Usage: report.py ORDERS.csv

Prints one line per customer, "<customer>\t<total>", highest total first.
"""

import sys


def main(path):
    totals = {}
    with open(path, encoding="utf-8") as f:
        next(f)  # header
        for line in f:
            order_id, customer, sku, quantity, unit_price, status = line.strip().split(",")
            if status == "cancelled":
                continue
            sign = -1 if status == "refund" else 1
            totals[customer] = totals.get(customer, 0.0) + sign * int(quantity) * float(unit_price)
    for customer, total in sorted(totals.items(), key=lambda kv: kv[1], reverse=True):
        print(f"{customer}\t{total:.2f}")


if __name__ == "__main__":
    main(sys.argv[1])
