#!/bin/bash
cat > /app/rle.py <<'PY'
import itertools
import sys

for line in sys.stdin:
    line = line.rstrip("\n")
    print("".join(f"{ch}{len(list(run))}" for ch, run in itertools.groupby(line)))
PY
python3 /app/rle.py < /app/data/input.txt > /app/out.txt
