#!/bin/sh
# Installs the Debian packages the build and the tests need, when missing.
# Run by `make run` and `make test` on a fresh machine; a no-op afterwards.
set -e
need=""
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
# systemd (systemd-analyze, -socket-activate, -sysusers, -tmpfiles), groff-base
# and python3-prometheus-client serve the offline service tests (tests/service);
# python3-numpy and python3-pytest the Python binding's tests (tests/python),
# python3-venv the fresh virtual environment its wheel is installed into;
# clang with libclang-rt-14-dev (libFuzzer and the sanitizer runtimes) builds
# the fuzz target, valgrind runs the daemon under memcheck.
for pkg in build-essential pkg-config libuv1-dev libprotobuf-c-dev protobuf-c-compiler \
	libcmocka-dev clang libclang-rt-14-dev valgrind systemd groff-base \
	python3-prometheus-client python3-numpy python3-pytest python3-venv; do
	have_pkg "$pkg" || need="$need $pkg"
done
if [ -n "$need" ]; then
	echo "installing:$need"
	if [ "$(id -u)" -ne 0 ]; then
		echo "error: missing packages ($need) and not root; install them with apt-get" >&2
		exit 1
	fi
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq $need >/dev/null
fi
if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
	echo "error: the CUDA Toolkit (nvcc) is needed to build the kernels; install it under /usr/local/cuda" >&2
	exit 1
fi
