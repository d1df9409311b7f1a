#!/bin/bash
wc -l < /app/data/events.log > /app/line_count.txt
