"""Print stock levels per warehouse.

usage: python3 -m inventory.cli MOVEMENTS.csv

For every warehouse (sorted by name) prints a line ``== <warehouse>`` followed by one line
``<sku> <level>`` per sku seen in that warehouse (sorted by sku), where the level is
computed from that warehouse's movements only, starting from an empty stock.
"""
import sys

from .ledger import apply
from .parser import parse_file


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    movements = parse_file(argv[0])
    by_wh = {}
    for m in movements:
        by_wh.setdefault(m["warehouse"], []).append(m)
    for wh in sorted(by_wh):
        levels = apply(by_wh[wh])
        print(f"== {wh}")
        for sku in sorted(levels):
            print(f"{sku} {levels[sku]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
