#!/bin/bash
# Reference solution: the retention script in bash with GNU date (ISO week via %G-%V).
set -euo pipefail
cat > /app/prune-backups <<'SH'
#!/bin/bash
# prune-backups DIR DAILY WEEKLY: keep the DAILY newest backups and the newest backup of
# each of the WEEKLY newest ISO weeks; delete the other backup-YYYY-MM-DD.tar.gz files.
set -euo pipefail
usage() { echo "usage: prune-backups DIR DAILY WEEKLY ($1)" >&2; exit 2; }
[ $# -eq 3 ] || usage "three arguments"
dir=$1 daily=$2 weekly=$3
[ -d "$dir" ] || usage "$dir is not a folder"
[[ $daily =~ ^[0-9]+$ && $weekly =~ ^[0-9]+$ ]] || usage "counts must be integers >= 0"

declare -A week_of=()
dates=()
for path in "$dir"/backup-????-??-??.tar.gz; do
    [ -f "$path" ] && [ ! -L "$path" ] || continue
    day=${path##*/backup-}; day=${day%.tar.gz}
    [[ $day =~ ^[0-9]{4}-[0-9]{2}-[0-9]{2}$ ]] || continue
    # a real date only: GNU date normalises nothing when asked to print it back
    week=$(date -u -d "$day" +'%F %G-%V' 2>/dev/null) || continue
    [ "${week%% *}" = "$day" ] || continue
    week_of[$day]=${week#* }
    dates+=("$day")
done
[ ${#dates[@]} -gt 0 ] || exit 0
mapfile -t newest_first < <(printf '%s\n' "${dates[@]}" | sort -r)

declare -A keep=() seen_week=()
n=0 weeks=0
for day in "${newest_first[@]}"; do
    if [ "$n" -lt "$daily" ]; then keep[$day]=1; fi
    n=$((n + 1))
    w=${week_of[$day]}
    if [ -z "${seen_week[$w]:-}" ]; then
        seen_week[$w]=1
        if [ "$weeks" -lt "$weekly" ]; then keep[$day]=1; fi
        weeks=$((weeks + 1))
    fi
done
for ((i = ${#newest_first[@]} - 1; i >= 0; i--)); do
    day=${newest_first[i]}
    if [ -z "${keep[$day]:-}" ]; then
        rm -f -- "$dir/backup-$day.tar.gz"
        echo "backup-$day.tar.gz"
    fi
done
SH
chmod 755 /app/prune-backups
rm -rf /tmp/backups-try && cp -a /srv/backups /tmp/backups-try
/app/prune-backups /tmp/backups-try 7 4 | wc -l
