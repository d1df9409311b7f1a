#!/bin/bash
mkdir -p /app/bin /app/etc/cron.d
cat > /app/bin/rotate_logs.sh <<'SH'
#!/bin/bash
# Rotate *.log files larger than 1024 bytes in the given directory (copytruncate, keep 3).
dir="${1:-/app/var/log}"
for f in "$dir"/*.log; do
    [ -f "$f" ] && [ ! -L "$f" ] || continue
    size=$(stat -c %s -- "$f")
    [ "$size" -gt 1024 ] || continue
    rm -f -- "$f.3.gz"
    if [ -e "$f.2.gz" ]; then mv -- "$f.2.gz" "$f.3.gz"; fi
    if [ -e "$f.1.gz" ]; then mv -- "$f.1.gz" "$f.2.gz"; fi
    gzip -c -- "$f" > "$f.1.gz"
    : > "$f"
done
exit 0
SH
chmod 0755 /app/bin/rotate_logs.sh
cat > /app/etc/cron.d/logrotate <<'CRON'
# m h dom mon dow user command
15 3 * * * root /app/bin/rotate_logs.sh /app/var/log
CRON
