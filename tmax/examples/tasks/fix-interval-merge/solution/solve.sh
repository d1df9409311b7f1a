#!/bin/bash
python3 - <<'PY'
p = "/app/intervals/merge.py"
s = open(p).read()
s = s.replace("""    result = []
    for start, end in intervals:
        if result and start < result[-1][1]:
            result[-1] = (result[-1][0], end)""", """    result = []
    for start, end in sorted(intervals):
        if result and start <= result[-1][1]:
            result[-1] = (result[-1][0], max(end, result[-1][1]))""")
open(p, "w").write(s)
PY
cd /app && python3 -m unittest discover -s tests
