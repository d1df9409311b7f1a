#!/bin/bash
cd /app/srv
chmod -R o-w /app/srv
find /app/srv/scripts -type f -name '*.sh' -exec chmod 0750 {} +
find /app/srv/secrets -type d -exec chmod 0700 {} +
find /app/srv/secrets -type f -exec chmod 0600 {} +
