#!/bin/bash
sort -g /app/data/temps.txt | tail -n 1 > /app/max_temp.txt
