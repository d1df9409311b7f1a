#!/bin/bash
sort -n /app/data/numbers.txt > /app/sorted_numbers.txt
