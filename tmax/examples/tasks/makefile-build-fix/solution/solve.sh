#!/bin/bash
# Four defects: (1) typo VERSON in the Makefile -> empty version, (2) a recipe line indented
# with spaces instead of a tab -> "missing separator", (3) gen_version.py keeps the trailing
# newline of VERSION -> _version.py is not valid Python, (4) variance() divides by n.
set -e
cd /app/proj
sed -i 's/\$(shell cat VERSON)/$(shell cat VERSION)/' Makefile
sed -i 's/^    \$(PYTHON) tools\/gen_version.py/\t$(PYTHON) tools\/gen_version.py/' Makefile
sed -i 's/    version = f.read()$/    version = f.read().strip()/' tools/gen_version.py
sed -i 's|return sum((x - m) \*\* 2 for x in xs) / len(xs)$|return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)|' src/mathlib/stats.py
make clean
make dist
tar -tzf dist/mathlib-1.4.2.tar.gz
