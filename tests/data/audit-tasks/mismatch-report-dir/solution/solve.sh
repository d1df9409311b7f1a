#!/bin/bash
mkdir -p /app/out
{
  echo "ERROR $(awk '$2 == "ERROR"' /app/data/app.log | wc -l)"
  echo "WARN $(awk '$2 == "WARN"' /app/data/app.log | wc -l)"
} > /app/out/report.txt
