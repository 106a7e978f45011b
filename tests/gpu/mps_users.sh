#!/bin/sh
# Which MPS deployments of docs/MPS.md work with normd and a client of the
# same or of another user id, on GPU 0. Needs root (it runs normd and the
# clients as other uids) and nvidia-cuda-mps-control; starts and stops MPS
# control daemons of its own on private pipe directories. Each case starts
# normd under MPS as one uid and runs `normstress --mode enqueue` (every job
# checked on the GPU) as another, then says whether that matched the
# expectation: "ok" (the client's jobs ran and verified) or "blocked" (the
# client cannot start while normd's MPS server lives, so it times out).
# Usage: sh tests/gpu/mps_users.sh [BUILD_DIR]
set -u
B=${1:-build}
export LD_LIBRARY_PATH="$B/lib/gpu-host${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
B=$(cd "$B" && pwd)
ctl=$(command -v nvidia-cuda-mps-control || true)
[ -z "$ctl" ] && [ -x /usr/local/nvidia/bin/nvidia-cuda-mps-control ] &&
	ctl=/usr/local/nvidia/bin/nvidia-cuda-mps-control
if [ -z "$ctl" ] || [ "$(id -u)" != 0 ]; then
	echo "mps_users: skipped (needs root and nvidia-cuda-mps-control)"
	exit 0
fi
CLIENT_SECONDS=${CLIENT_SECONDS:-40}
failed=0

# as_user UID COMMAND...: runs COMMAND with that uid and gid and no groups.
as_user() {
	uid=$1
	shift
	if command -v setpriv >/dev/null 2>&1; then
		setpriv --reuid="$uid" --regid="$uid" --clear-groups "$@"
	else
		python3 -c 'import os, sys
u = int(sys.argv[1]); os.setgroups([]); os.setgid(u); os.setuid(u)
os.execvp(sys.argv[2], sys.argv[2:])' "$uid" "$@"
	fi
}

# run_case NAME NORMD_UID CLIENT_UID EXPECT [CONTROL_FLAGS]
run_case() {
	name=$1 normd_uid=$2 client_uid=$3 expect=$4 flags=${5:-}
	dir=$(mktemp -d /tmp/normd-mps-users.XXXXXX)
	mkdir -p "$dir/pipe" "$dir/log" "$dir/state"
	chmod -R 0777 "$dir"
	export CUDA_MPS_PIPE_DIRECTORY="$dir/pipe" CUDA_MPS_LOG_DIRECTORY="$dir/log"
	# shellcheck disable=SC2086
	if ! "$ctl" -d $flags >"$dir/control.out" 2>&1; then
		echo "$name: SKIPPED (nvidia-cuda-mps-control -d $flags: $(cat "$dir/control.out"))"
		rm -rf "$dir"
		return
	fi
	sock="$dir/s.sock"
	as_user "$normd_uid" "$B/bin/normd" --config /dev/null --device 0 --socket "$sock" \
		--socket-mode 0666 --state-dir "$dir/state" >"$dir/normd.log" 2>&1 &
	normd_pid=$!
	i=0
	until [ -S "$sock" ] && "$B/bin/normctl" --socket "$sock" ping >/dev/null 2>&1; do
		i=$((i + 1))
		if [ $i -gt 300 ] || ! kill -0 "$normd_pid" 2>/dev/null; then
			break
		fi
		sleep 0.2
	done
	mps=$(grep -o "mps=[a-z]*" "$dir/normd.log" | head -1)
	start=$(date +%s)
	as_user "$client_uid" timeout -k 5 "$CLIENT_SECONDS" "$B/bin/normstress" --socket "$sock" \
		--mode enqueue --procs 2 --jobs 4000 --verify 1 >"$dir/client.log" 2>&1
	rc=$?
	took=$(($(date +%s) - start))
	pkill -KILL -u "$client_uid" normstress 2>/dev/null
	kill -TERM "$normd_pid" 2>/dev/null
	wait "$normd_pid" 2>/dev/null
	echo quit | timeout 20 "$ctl" >/dev/null 2>&1
	if [ "$rc" = 0 ]; then
		got=ok
	elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
		got=blocked
	else
		got="failed (exit $rc)"
	fi
	verdict=PASS
	[ "$got" = "$expect" ] || verdict=FAIL
	[ "$verdict" = FAIL ] && failed=$((failed + 1))
	echo "$name: normd uid $normd_uid ($mps), client uid $client_uid: $got after ${took} s," \
		"expected $expect: $verdict"
	grep -E "^jobs|^verify|^result" "$dir/client.log" | sed 's/^/    /'
	if [ "$verdict" = FAIL ]; then
		tail -5 "$dir/client.log" | sed 's/^/    client: /'
		tail -5 "$dir/normd.log" | sed 's/^/    normd: /'
	fi
	unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
	rm -rf "$dir"
}

run_case "same user (deployment a)" 65534 65534 ok
run_case "two users, one MPS server per user" 65534 65533 blocked
run_case "two users, -multiuser-server (deployment b)" 65534 65533 ok -multiuser-server
echo "mps_users: $failed case(s) not as expected"
[ "$failed" = 0 ]
