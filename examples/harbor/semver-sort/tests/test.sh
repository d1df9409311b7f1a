#!/bin/bash

apt-get update
apt-get install -y curl

curl -LsSf https://astral.sh/uv/0.9.7/install.sh | sh

source $HOME/.local/bin/env

core=0
prerelease=0
validation=0

uvx \
  --with pytest==8.4.1 \
  --with pytest-json-ctrf==0.3.5 \
  pytest --ctrf /logs/verifier/ctrf_core.json /tests/test_core.py -rA \
  && core=1

uvx \
  --with pytest==8.4.1 \
  --with pytest-json-ctrf==0.3.5 \
  pytest --ctrf /logs/verifier/ctrf_prerelease.json /tests/test_prerelease.py -rA \
  && prerelease=1

uvx \
  --with pytest==8.4.1 \
  --with pytest-json-ctrf==0.3.5 \
  pytest --ctrf /logs/verifier/ctrf_validation.json /tests/test_validation.py -rA \
  && validation=1

python3 -c "
import json
scores = {'core': $core, 'prerelease': $prerelease, 'validation': $validation}
json.dump({'reward': round(sum(scores.values()) / len(scores), 4), **scores},
          open('/logs/verifier/reward.json', 'w'))
"
