#!/bin/bash
mkdir -p /app/outputs
awk '{print NF}' /app/data/poem.txt > /app/outputs/counts.txt
