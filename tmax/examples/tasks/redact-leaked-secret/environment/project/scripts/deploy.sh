#!/bin/bash
# Deploys billing-sync to the staging host.
set -eu
export AWS_ACCESS_KEY_ID="AKIAAHIXMK4AJFQL6I2I"
export AWS_SECRET_ACCESS_KEY="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"
rsync -a --delete ./ deploy@staging.internal:/srv/billing-sync/
ssh deploy@staging.internal 'systemctl restart billing-sync'
