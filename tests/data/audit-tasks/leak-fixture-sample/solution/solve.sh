#!/bin/bash
awk '{print $9}' /app/data/access.log | sort -n | uniq -c | awk '{print $2, $1}' > /app/status_counts.txt
