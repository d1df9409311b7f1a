#!/bin/bash
# Terminal-Bench 1 style: the verifier's own script, run with TEST_DIR set.
python3 "$TEST_DIR/test_outputs.py"
