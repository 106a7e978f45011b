#!/bin/sh
# The wheel `make wheel` builds is a platform wheel that carries a
# libnormclient needing only the C library; pip installs it, offline, into a
# fresh virtual environment; and there, with nothing of the repository on
# sys.path and no $NORMD_LIBRARY, the package loads the library it carries
# and runs jobs through a CPU-backend daemon (tests/python/wheel_check.py).
#   sh tests/python/test_wheel.sh BUILD_DIR
. tests/service/lib.sh
REPO=$(pwd)

make -s --no-print-directory B="$B" wheel >"$T/make.log" 2>&1 || fail "make wheel"
set -- "$B"/wheel/normd-*.whl
[ $# -eq 1 ] && [ -f "$1" ] || fail "expected one wheel in $B/wheel, found: $*"
wheel=$1
case "$(basename "$wheel")" in
normd-*-py3-none-linux_*.whl) ;;
*) fail "$(basename "$wheel") is not a py3-none-linux_* platform wheel" ;;
esac
check "make wheel: $(basename "$wheel")"

# A venv with the ensurepip that Debian's python3-venv provides.
for py in ${NORMD_TEST_PYTHON:-} /usr/bin/python3 python3; do
	"$py" -m venv "$T/venv" >"$T/venv.log" 2>&1 && break
	rm -rf "$T/venv"
done
[ -x "$T/venv/bin/python" ] || fail "python3 -m venv (tests/install-deps.sh installs python3-venv)"
# --no-index: nothing is downloaded; the wheel has no dependencies.
"$T/venv/bin/python" -m pip install --no-index --no-cache-dir --disable-pip-version-check -q \
	"$wheel" >"$T/pip.log" 2>&1 || fail "pip install $wheel"
check "pip install --no-index into a fresh venv ($("$T/venv/bin/python" -V 2>&1))"

lib=$(find "$T/venv" -path '*/site-packages/normd/libnormclient.so.0')
[ -n "$lib" ] || fail "the installed package has no normd/libnormclient.so.0"
needed=$(readelf -d "$lib" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | sort | paste -sd ' ')
[ "$needed" = "ld-linux-x86-64.so.2 libc.so.6" ] ||
	fail "the bundled library needs more than the C library: $needed"
readelf -d "$lib" | grep -q TEXTREL && fail "the bundled library has text relocations"
exported=$(nm -D --defined-only "$lib" | awk '$3 !~ /^nc_/' | wc -l)
[ "$exported" -eq 0 ] || fail "the bundled library exports $exported symbols other than nc_*"
check "the bundled library needs only $needed and exports only nc_*"

(cd "$T" && env -u PYTHONPATH -u NORMD_LIBRARY -u NORMD_SOCKET "$T/venv/bin/python" -I \
	"$REPO/tests/python/wheel_check.py" "$REPO" "$REPO/$B/bin/normd" \
	"$REPO/$B/lib/libnormclient.so.0") >"$T/check.log" 2>&1 || fail "wheel_check.py"
cat "$T/check.log"
