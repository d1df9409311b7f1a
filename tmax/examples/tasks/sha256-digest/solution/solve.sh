#!/bin/bash
sha256sum /app/firmware.bin | cut -d' ' -f1 > /app/answer.txt
