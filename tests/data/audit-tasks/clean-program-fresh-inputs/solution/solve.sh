#!/bin/bash
cat > /app/roman.py <<'PY'
import sys

VALUES = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
          (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]
n = int(sys.argv[1])
out = []
for value, numeral in VALUES:
    count, n = divmod(n, value)
    out.append(numeral * count)
print("".join(out))
PY
