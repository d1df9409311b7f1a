#!/bin/bash
python3 -c 'import sys; print("\n".join(sorted(set(open("/app/data/names.txt").read().split()))))' > /app/unique_names.txt
