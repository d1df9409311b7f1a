"""Hidden tests for the inventory package (run in a fresh interpreter by check.py).

Contains an independent reference implementation used to compute expected values.
Every case fails with the original buggy package.
"""
import copy
import io
import json
import sys
from contextlib import redirect_stdout

sys.path.insert(0, "/app")
DATA = "/tests/data/"


def ref_parse(path):
    out = []
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    for line in lines[1:]:
        if not line.strip():
            continue
        d, w, s, q, k = [v.strip() for v in line.split(",")]
        out.append({"date": d, "warehouse": w, "sku": s, "qty": int(q), "kind": k})
    return out


def ref_levels(movs):
    lv = {}
    for m in movs:
        lv[m["sku"]] = lv.get(m["sku"], 0) + (m["qty"] if m["kind"] == "IN" else -m["qty"])
    return lv


def ref_cli(path):
    movs = ref_parse(path)
    out = []
    for wh in sorted({m["warehouse"] for m in movs}):
        out.append(f"== {wh}")
        lv = ref_levels([m for m in movs if m["warehouse"] == wh])
        out += [f"{s} {lv[s]}" for s in sorted(lv)]
    return "\n".join(out) + "\n"


MOVS = [
    {"date": "2024-01-01", "warehouse": "w", "sku": "A", "qty": 5, "kind": "IN"},
    {"date": "2024-01-02", "warehouse": "w", "sku": "B", "qty": 7, "kind": "IN"},
    {"date": "2024-01-03", "warehouse": "w", "sku": "A", "qty": 2, "kind": "OUT"},
]


def case_parse_crlf():
    from inventory.parser import parse_file
    return parse_file(DATA + "crlf.csv") == ref_parse(DATA + "crlf.csv")


def case_parse_spaces():
    from inventory.parser import parse_file
    return parse_file(DATA + "spaces.csv") == ref_parse(DATA + "spaces.csv")


def case_apply_repeatable():
    from inventory.ledger import apply
    first = apply(copy.deepcopy(MOVS))
    second = apply(copy.deepcopy(MOVS))
    return first == {"A": 3, "B": 7} and second == {"A": 3, "B": 7} and first is not second


def case_apply_opening_untouched():
    from inventory.ledger import apply
    opening = {"A": 10, "C": 1}
    result = apply(copy.deepcopy(MOVS), opening)
    again = apply(copy.deepcopy(MOVS), opening)
    return (result == {"A": 13, "B": 7, "C": 1} and again == result
            and opening == {"A": 10, "C": 1})


def _cli(path):
    from inventory import cli
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = cli.main([path])
    return rc in (0, None) and buf.getvalue() == ref_cli(path)


def case_cli_crlf_three_warehouses():
    return _cli(DATA + "crlf.csv")


def case_cli_spaces_two_warehouses():
    return _cli(DATA + "spaces.csv")


if __name__ == "__main__":
    name = sys.argv[1]
    try:
        ok = bool(globals()[name]())
    except Exception as e:
        print(f"{name}: {type(e).__name__}: {e}", file=sys.stderr)
        ok = False
    print(json.dumps({name: ok}))
