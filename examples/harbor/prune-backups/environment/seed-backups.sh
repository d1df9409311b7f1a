#!/bin/bash
# seed-backups DIR LAST_DAY: a backup folder as the nightly job leaves it, up to LAST_DAY.
set -euo pipefail
dir=$1 last=$2
mkdir -p "$dir/old"
for back in $(seq 0 9) $(seq 11 3 70) $(seq 75 9 200); do
    day=$(date -u -d "$last - $back days" +%F)
    echo "archive of $day" > "$dir/backup-$day.tar.gz"
done
# Not backups: they must survive any pruning.
echo "2023 audit copy" > "$dir/old/backup-2023-01-01.tar.gz"
echo "half written" > "$dir/backup-2024-12-31.tar.gz.partial"
echo "bad date" > "$dir/backup-2024-02-30.tar.gz"
echo "keep me" > "$dir/README.txt"
