#!/bin/sh
# The Python binding's tests (bindings/python) against a CPU-backend daemon:
# pytest over tests/python, with the first interpreter that has numpy and
# pytest (tests/install-deps.sh installs Debian's python3-numpy and
# python3-pytest for /usr/bin/python3). Tests that need torch are skipped
# where it is not installed.
#   sh tests/python/run.sh BUILD_DIR
set -u
B=${1:-build}
export NORMD_BIN="$B/bin/normd"
# Leave no __pycache__ or .pytest_cache in the tree.
export PYTHONDONTWRITEBYTECODE=1
for py in ${NORMD_TEST_PYTHON:-} /usr/bin/python3 python3; do
	if "$py" -c "import numpy, pytest" >/dev/null 2>&1; then
		exec "$py" -m pytest -q -p no:cacheprovider tests/python
	fi
done
echo "error: no python3 with numpy and pytest (tests/install-deps.sh installs python3-numpy and python3-pytest)" >&2
exit 1
