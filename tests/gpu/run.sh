#!/bin/sh
# Runs every GPU test program in BUILD_DIR/tests/gpu, each in its own
# process with a timeout; prints each program's summary and a total, and
# exits non-zero if any program failed.
# Usage: sh tests/gpu/run.sh BUILD_DIR
set -u
build=${1:-build}
timeout_s=${GPU_TEST_TIMEOUT:-900}
status=0
found=0
# Libraries the GPU machine lacks (it has no Debian packages), copied by `make gpu-progs`.
export LD_LIBRARY_PATH="$build/lib/gpu-host${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# check NAME COMMAND...: runs COMMAND (under the timeout) between "== NAME" and its outcome.
check() {
	name=$1
	shift
	echo "== $name"
	if timeout "$timeout_s" "$@"; then
		echo "== $name: ok"
	else
		echo "== $name: FAILED (exit $?)"
		status=1
	fi
}

for t in "$build"/tests/gpu/test_*; do
	[ -x "$t" ] || continue
	found=1
	check "$(basename "$t")" "$t"
done
# The Python binding against PyTorch, where python3 has torch.
if python3 -c "import torch" >/dev/null 2>&1; then
	found=1
	# The package's Python path, then the compiled eager operator (normd.eager).
	for eager in 0 1; do
		check "test_python.py (NORMD_EAGER=$eager)" \
			env NORMD_EAGER=$eager python3 tests/gpu/test_python.py "$build"
	done
	# A process under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True from its start (VMM regions).
	check test_vmm_torch.py python3 tests/gpu/test_vmm_torch.py "$build"
else
	echo "== test_python.py: skipped (python3 cannot import torch)"
	echo "== test_vmm_torch.py: skipped (python3 cannot import torch)"
fi
# torch.compile and CUDA graphs, then the norm variants of normd.normalization,
# eager and compiled (pytest; each file starts its own daemon on GPU 0).
if python3 -c "import torch, pytest" >/dev/null 2>&1; then
	# The ops' Python implementation, then the compiled eager operator's kernels (normd.eager).
	for eager in 0 1; do
		check "test_compile.py (NORMD_EAGER=$eager)" \
			env NORMD_EAGER=$eager NORMD_BIN="$build/bin/normd" PYTHONDONTWRITEBYTECODE=1 \
			python3 -m pytest -q -rs -p no:cacheprovider tests/python/test_compile.py
	done
	check "test_variants.py test_variant_compile.py" \
		env NORMD_BIN="$build/bin/normd" PYTHONDONTWRITEBYTECODE=1 \
		python3 -m pytest -q -rs -p no:cacheprovider tests/python/test_variants.py \
		tests/python/test_variant_compile.py
else
	for name in test_compile.py "test_variants.py test_variant_compile.py"; do
		echo "== $name: skipped (python3 cannot import torch and pytest)"
	done
fi
# MPS with one and two user ids (docs/MPS.md's deployments; needs root, else it skips).
check mps_users.sh sh tests/gpu/mps_users.sh "$build"
if [ "$found" = 0 ]; then
	echo "no GPU test programs in $build/tests/gpu" >&2
	exit 1
fi
exit $status
