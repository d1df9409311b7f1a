#!/bin/bash
set -e
printf 'name=web\nport=8080\nworkers=4\n' > /home/user/app/service.conf
chmod -R a+rwX /home/user
