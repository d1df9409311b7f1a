#!/bin/bash
tail -n +2 /app/data/scores.csv | sort -t, -k2,2n | cut -d, -f1 > /app/ranking.txt
