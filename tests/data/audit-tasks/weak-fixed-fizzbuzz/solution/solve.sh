#!/bin/bash
cat > /app/fizzbuzz.py <<'PY'
import sys

for i in range(1, int(sys.argv[1]) + 1):
    if i % 15 == 0:
        print("FizzBuzz")
    elif i % 3 == 0:
        print("Fizz")
    elif i % 5 == 0:
        print("Buzz")
    else:
        print(i)
PY
python3 /app/fizzbuzz.py 20 > /app/out.txt
