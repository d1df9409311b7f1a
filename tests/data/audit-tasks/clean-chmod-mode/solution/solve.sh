#!/bin/bash
chmod 755 /app/bin/backup.sh
chmod 600 /app/secret.key
