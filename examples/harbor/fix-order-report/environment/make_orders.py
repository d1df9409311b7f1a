"""Writes a sample orders.csv for the shop report (run once, at image build time)."""

import argparse
import csv
import random

CUSTOMERS = ["Acme Corp", "Lopez, Ana", "Bright & Sons", "Zhou Wei", "Okafor, Chidi",
             "Nordic Supply", "M\u00fcller GmbH", "Blue Heron Cafe", "Patel, R.", "Kim Ji-woo"]
SKUS = ["SKU-100", "SKU-204", "SKU-317", "SKU-452", "SKU-590"]
STATUSES = ["paid"] * 7 + ["refunded", "refunded", "cancelled"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--rows", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with open(args.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["order_id", "customer", "sku", "quantity", "unit_price", "status"])
        for i in range(1, args.rows + 1):
            price = f"{rng.randint(50, 25000) / 100:.2f}"
            w.writerow([f"A{i:05d}", rng.choice(CUSTOMERS), rng.choice(SKUS),
                        rng.randint(1, 9), price, rng.choice(STATUSES)])


if __name__ == "__main__":
    main()
