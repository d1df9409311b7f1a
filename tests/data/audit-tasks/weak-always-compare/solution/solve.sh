#!/bin/bash
sort /app/data/fruit.txt > /app/sorted_fruit.txt
