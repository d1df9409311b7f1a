#!/bin/bash
python3 - <<'PY'
from decimal import Decimal, ROUND_HALF_UP
with open("/app/data/celsius.txt") as f, open("/app/fahrenheit.txt", "w") as out:
    for line in f:
        if line.strip():
            v = (Decimal(line.strip()) * 9 / 5 + 32).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP)
            out.write(f"{v}\n")
PY
