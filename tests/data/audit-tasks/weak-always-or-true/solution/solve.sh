#!/bin/bash
tac /app/data/words.txt > /app/reversed.txt
