#!/bin/bash
# Verifier: always leaves exactly one float in /logs/verifier/reward.txt.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
cd /app 2>/dev/null || true
python3 /tests/check.py || echo "check.py failed; reward stays 0"
exit 0
