#!/bin/bash
sed -i -e 's/^port = 8080$/port = 9090/' -e 's/^debug = true$/debug = false/' /app/config.ini
