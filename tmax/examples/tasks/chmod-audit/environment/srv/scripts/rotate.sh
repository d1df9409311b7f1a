#!/bin/bash
find /app/srv/www/uploads -mtime +30 -delete
