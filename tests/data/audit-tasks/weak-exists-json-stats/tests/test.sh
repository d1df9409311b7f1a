#!/bin/bash
# Verifier: always leaves exactly one float in /logs/verifier/reward.txt.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
if [ -f /app/stats.json ]; then
    echo "stats.json found"
    echo 1 > /logs/verifier/reward.txt
else
    echo "stats.json missing"
fi
exit 0
