#!/bin/bash
mkdir -p /app/logs && tar -xzf /app/logs.tar.gz -C /app/logs
