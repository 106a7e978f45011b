# Sourced by the benchmark scripts (bench/*.sh): waits for a normd they started.
#
# normd_wait_ready SOCKET PID LOG BUILD_DIR: waits until the normd of PID
# answers a ping on SOCKET, up to 60 s (under MPS its first context also
# starts the MPS server). Returns 0, or 1 after printing the end of LOG when
# it exited or never answered.
normd_wait_ready() {
	_i=0
	until [ -S "$1" ] && "$4/bin/normctl" --socket "$1" ping >/dev/null 2>&1; do
		_i=$((_i + 1))
		if [ $_i -gt 600 ] || ! kill -0 "$2" 2>/dev/null; then
			echo "normd did not start:"
			tail -20 "$3"
			return 1
		fi
		sleep 0.1
	done
}
