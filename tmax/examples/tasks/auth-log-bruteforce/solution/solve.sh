#!/bin/bash
grep 'Failed password for' /app/var/log/auth.log \
  | sed -E 's/.* from ([0-9a-fA-F:.]+) port .*/\1/' \
  | sort | uniq -c | awk '$1 >= 5 {print $2}' > /app/blocklist.txt
