#!/bin/bash
tar -czf /app/srv/data/backup.tgz /app/srv/www
