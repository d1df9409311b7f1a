#!/bin/bash
# Bug 1 (parser): fields are not stripped, so CRLF line ends and padding leak into values
# ('  IN\r'), which the ledger then rejects as an unknown kind.
# Bug 2 (ledger): mutable default argument `stock={}` that is also mutated in place, so
# results accumulate across calls (every warehouse after the first is wrong).
python3 - <<'PY'
p = "/app/inventory/parser.py"
s = open(p).read()
s = s.replace('    values = line.split(",")\n', '    values = [v.strip() for v in line.split(",")]\n')
open(p, "w").write(s)

p = "/app/inventory/ledger.py"
s = open(p).read()
s = s.replace("def apply(movements, stock={}):", "def apply(movements, stock=None):")
s = s.replace('    for m in movements:\n',
              '    stock = dict(stock) if stock else {}\n    for m in movements:\n', 1)
open(p, "w").write(s)
PY
cd /app && python3 -m inventory.cli /app/data/movements.csv
