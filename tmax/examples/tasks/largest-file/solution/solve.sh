#!/bin/bash
find /app/files -type f -printf '%s %f\n' | sort -n | tail -n 1 | cut -d' ' -f2 > /app/answer.txt
