#!/bin/sh
# Runs one integration test program with its daemon under valgrind memcheck:
# no invalid read or write, no use of uninitialised memory, no definitely
# lost block, or the run fails and prints valgrind's report.
#   sh tests/valgrind-run.sh BUILD_DIR TEST_NAME
set -u
B=$(cd "$1" && pwd)
test=$2
dir=$(mktemp -d /tmp/normd-valgrind.XXXXXX)
# The test starts $NORMD_BIN with the daemon's arguments; this wrapper puts
# valgrind in front. No suppressions are needed: the statically linked cudart
# stays untouched on the CPU backend, and valgrind reports nothing from it.
cat >"$dir/normd" <<WRAPPER
#!/bin/sh
exec valgrind --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=definite \\
	--show-leak-kinds=definite --num-callers=40 \\
	--log-file=$dir/valgrind.%p.log "$B/bin/normd" "\$@"
WRAPPER
chmod +x "$dir/normd"
NORMD_BIN="$dir/normd" "$B/tests/integration/$test"
rc=$?
logs=$(ls "$dir"/valgrind.*.log 2>/dev/null)
if [ -z "$logs" ]; then
	echo "valgrind wrote no log: the daemon did not run under it" >&2
	rc=1
fi
for log in $logs; do
	if ! grep -q "ERROR SUMMARY: 0 errors" "$log"; then
		echo "valgrind reports errors in the daemon:" >&2
		cat "$log" >&2
		rc=1
	fi
done
[ $rc -eq 0 ] && [ -z "${NORMD_KEEP_VALGRIND:-}" ] && rm -rf "$dir"
exit $rc
