#!/bin/bash
grep -o '<[^>]*>' /app/data/contacts.txt | tr -d '<>' | tr '[:upper:]' '[:lower:]' | LC_ALL=C sort -u > /app/emails.txt
