#!/bin/bash
sqlite3 /app/shop.db 'SELECT COUNT(*) FROM orders;' > /app/answer.txt
