#!/bin/sh
echo "backup done"
