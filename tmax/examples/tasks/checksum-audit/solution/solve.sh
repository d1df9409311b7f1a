#!/bin/bash
cd /app/release
sha256sum -c SHA256SUMS 2>/dev/null | grep -v ': OK$' | sed -E 's/: FAILED.*$//' | sort > /app/tampered.txt
