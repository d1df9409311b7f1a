"""Grades /srv/shop/report.py by running it on order files generated here and comparing its
output with a reference report computed here (exact cents, ties by name)."""

import csv
import random
import subprocess
from decimal import Decimal
from pathlib import Path

import pytest

REPORT = "/srv/shop/report.py"
SAMPLE = "/srv/shop/data/orders.csv"
HEADER = ["order_id", "customer", "sku", "quantity", "unit_price", "status"]
NAMES = ["Acme Corp", "Lopez, Ana", 'The "Best" Bakery', "Zhou Wei", "Okafor, Chidi",
         "M\u00fcller GmbH", "acme corp", "Blue Heron Cafe", "Patel, R.", "Kim Ji-woo",
         "\u00c5ngstr\u00f6m AB", "Nordic Supply"]


def expected(path: Path) -> str:
    totals: dict[str, int] = {}
    with open(path, encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            sign = {"paid": 1, "refunded": -1}.get(row["status"])
            if sign is not None:
                cents = int(Decimal(row["unit_price"]) * 100) * int(row["quantity"])
                totals[row["customer"]] = totals.get(row["customer"], 0) + sign * cents
    lines = []
    for name, cents in sorted(totals.items(), key=lambda kv: (-kv[1], kv[0])):
        sign = "-" if cents < 0 else ""
        lines.append(f"{name}\t{sign}{abs(cents) // 100}.{abs(cents) % 100:02d}")
    return "".join(line + "\n" for line in lines)


def write_orders(path: Path, rows: list[tuple[str, int, str, str]]) -> Path:
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(HEADER)
        for i, (name, qty, price, status) in enumerate(rows, 1):
            w.writerow([f"T{i:05d}", name, f"SKU-{i % 7}", qty, price, status])
    return path


def random_rows(rng: random.Random) -> list[tuple[str, int, str, str]]:
    names = rng.sample(NAMES, rng.randint(2, len(NAMES)))
    statuses = ["paid"] * 6 + ["refunded"] * 3 + ["cancelled"]
    return [(rng.choice(names), rng.randint(1, 12), f"{rng.randint(1, 40000) / 100:.2f}",
             rng.choice(statuses)) for _ in range(rng.randint(1, 80))]


def run_report(path: Path) -> str:
    proc = subprocess.run(["python3", REPORT, str(path)], capture_output=True, check=False,
                          timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-2000:]
    return proc.stdout.decode("utf-8")


def test_sample_export():
    assert run_report(Path(SAMPLE)) == expected(Path(SAMPLE))


@pytest.mark.parametrize("seed", range(25))
def test_generated_exports(tmp_path, seed):
    orders = write_orders(tmp_path / "orders.csv", random_rows(random.Random(seed)))
    assert run_report(orders) == expected(orders)


def test_refunds_zero_totals_and_ties(tmp_path):
    orders = write_orders(tmp_path / "orders.csv", [
        ("Zeta, Z", 1, "0.30", "paid"), ("Zeta, Z", 1, "0.10", "refunded"),
        ("Zeta, Z", 1, "0.20", "refunded"),  # nets to zero: floats give -0.00
        ("Beta", 2, "5.00", "paid"), ("Alpha", 1, "10.00", "paid"),  # a tie, out of order
        ("Gamma", 3, "1.10", "refunded"), ("Gamma", 1, "9.99", "cancelled"),
        ("Only Cancelled", 1, "1.00", "cancelled"),
    ])
    assert run_report(orders) == "Alpha\t10.00\nBeta\t10.00\nZeta, Z\t0.00\nGamma\t-3.30\n"
    assert run_report(orders) == expected(orders)
