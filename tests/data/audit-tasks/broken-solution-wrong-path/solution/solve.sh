#!/bin/bash
grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' /app/config/settings.conf > /app/config/settings.clean
