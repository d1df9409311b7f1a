#!/bin/bash
cat > /app/wordfreq.py <<'PY'
import collections
import re
import sys

words = re.findall(r"[a-z]+", open(sys.argv[1]).read().lower())
counts = collections.Counter(words)
for word, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:3]:
    print(word, n)
PY
python3 /app/wordfreq.py /app/data/text.txt > /app/out.txt
