#!/bin/bash
tr '[:lower:]' '[:upper:]' < /app/data/poem.txt > /app/upper.txt
