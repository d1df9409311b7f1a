#!/bin/bash
wc -l < /app/data/access.log > /app/answer.txt
