# normd: one entry point for building, testing, benchmarking and installing.
#
#   make            build everything into build/
#   make run        build, start normd on a private socket, run `normctl demo`, stop
#   make test       install missing build dependencies, build, run the whole suite
#                   (also under ASan/UBSan and valgrind, and 60 s of fuzzing)
#   make test-asan  the unit and integration tests built with ASan + UBSan
#   make fuzz       fuzz the frame decoder and request validation (FUZZ_SECONDS=300)
#   make test-gpu   GPU tests (on a machine with an NVIDIA GPU)
#   make bench-gpu  GPU benchmarks (on a machine with an NVIDIA GPU)
#   make install    install under PREFIX (/usr/local) into DESTDIR (README.md)
#   make wheel      the Python package as a wheel carrying libnormclient
#                   (build/wheel; bindings/python/README.md)
#
# Generated code goes to build/gen, objects to build/obj, products to
# build/bin, build/lib and build/tests. Nothing is written into the tree.

PREFIX ?= /usr/local
DESTDIR ?=
# Install locations (make install; see README.md). The config file goes to
# /etc whatever the prefix, where normd looks for it by default.
BINDIR ?= $(PREFIX)/bin
SBINDIR ?= $(PREFIX)/sbin
LIBDIR ?= $(PREFIX)/lib
INCLUDEDIR ?= $(PREFIX)/include
MANDIR ?= $(PREFIX)/share/man
SYSCONFDIR ?= /etc
UNITDIR ?= $(PREFIX)/lib/systemd/system
SYSUSERSDIR ?= $(PREFIX)/lib/sysusers.d
TMPFILESDIR ?= $(PREFIX)/lib/tmpfiles.d
B := build
CUDA_HOME ?= /usr/local/cuda
NVCC ?= $(CUDA_HOME)/bin/nvcc
CC ?= cc
# The one version: the library's file name, normclient.pc and the daemon's
# HelloReply.server_version ($(B)/gen/normd_version.h) take it from here.
VERSION := 0.1.0
SOVERSION := 0

WARN := -Wall -Wextra -Werror -Wshadow -Wstrict-prototypes -Wmissing-prototypes
CFLAGS ?= -O2 -g
BASE_CFLAGS := -std=c11 -D_GNU_SOURCE $(WARN) -fvisibility=hidden -MMD -MP \
	-I. -Iclient/include -I$(B)/gen -I$(CUDA_HOME)/include
ALL_CFLAGS = $(BASE_CFLAGS) $(CFLAGS) $(EXTRA_CFLAGS)

# Static libuv, protobuf-c and cudart: binaries built here run on a GPU host
# that has only the NVIDIA driver. (libnormclient.so links libprotobuf-c.so:
# Debian's libprotobuf-c.a is not position-independent.)
STATIC_UV := -l:libuv_a.a
STATIC_PB := -l:libprotobuf-c.a
CUDART := -L$(CUDA_HOME)/lib64 -lcudart_static -ldl -lrt
SYS_LIBS := -lpthread -lm

# Kernels: sm_80 and sm_90 machine code plus PTX for newer devices.
NVCC_ARCH := -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90 \
	-gencode=arch=compute_90,code=compute_90
NVCC_FLAGS := -O3 -std=c++17 -I. $(NVCC_ARCH) -Xcompiler -fPIC,-Wall,-Wextra,-Werror \
	-Xptxas -warn-spills --expt-relaxed-constexpr

.SECONDARY:
.PHONY: all run test test-unit test-asan test-gpu bench-gpu deps clean install uninstall fuzz
all: $(B)/bin/normd $(B)/bin/normctl $(B)/bin/normstress $(B)/lib/libnormclient.a \
	$(B)/lib/libnormclient.so $(B)/lib/pkgconfig/normclient.pc tests

# ---- generated protocol code -------------------------------------------------
$(B)/gen/normd.pb-c.c $(B)/gen/normd.pb-c.h: proto/normd.proto
	@mkdir -p $(B)/gen
	protoc-c --proto_path=proto --c_out=$(B)/gen proto/normd.proto

# NORMD_VERSION for C code. Written on every make but replaced only when
# VERSION changed (make VERSION=... too), so that what includes it (through
# the .d files) is rebuilt then and only then.
.PHONY: version-header
version-header:
$(B)/gen/normd_version.h: version-header
	@mkdir -p $(B)/gen
	@printf '/* Written by the Makefile from VERSION. */\n#define NORMD_VERSION "%s"\n' \
		'$(VERSION)' > $@.tmp
	@if cmp -s $@.tmp $@; then rm -f $@.tmp; else mv $@.tmp $@; fi

# ---- objects -----------------------------------------------------------------
$(B)/obj/%.o: %.c | $(B)/gen/normd.pb-c.h $(B)/gen/normd_version.h
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -c $< -o $@

# Position-independent twins for the shared client library.
$(B)/pic/%.o: %.c | $(B)/gen/normd.pb-c.h $(B)/gen/normd_version.h
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -fPIC -c $< -o $@

$(B)/obj/gen/normd.pb-c.o: $(B)/gen/normd.pb-c.c
	@mkdir -p $(dir $@)
	$(CC) -std=c11 -O2 -g -fPIC -fvisibility=hidden -I$(B)/gen -c $< -o $@

$(B)/obj/kernels/%.cu.o: kernels/%.cu kernels/norm_kernels.h kernels/norm_cuda_variant.h \
		$(wildcard kernels/*.cuh)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCC_FLAGS) -c $< -o $@

PROTO_OBJS := $(B)/obj/gen/normd.pb-c.o $(B)/obj/proto/frame.o
KERNEL_CPU_OBJS := $(B)/obj/kernels/norm_cpu.o $(B)/obj/kernels/norm_cpu_f32.o \
	$(B)/obj/kernels/norm_cpu_f64.o $(B)/obj/kernels/norm_common.o \
	$(B)/obj/kernels/norm_cuda_policy.o $(B)/obj/kernels/cuda_driver.o \
	$(B)/obj/kernels/wgrad_cpu.o $(B)/obj/kernels/wgrad_cublas.o
KERNEL_CUDA_OBJS := $(patsubst kernels/%.cu,$(B)/obj/kernels/%.cu.o,$(wildcard kernels/*.cu))
DAEMON_SRCS := $(wildcard daemon/*.c)
DAEMON_OBJS := $(patsubst %.c,$(B)/obj/%.o,$(DAEMON_SRCS))
CLIENT_SRCS := $(wildcard client/lib/*.c)
CLIENT_OBJS := $(patsubst %.c,$(B)/obj/%.o,$(CLIENT_SRCS))
CLIENT_PIC_OBJS := $(patsubst %.c,$(B)/pic/%.o,$(CLIENT_SRCS) proto/frame.c kernels/cuda_driver.c)

$(B)/lib/libnormkernels.a: $(KERNEL_CPU_OBJS) $(KERNEL_CUDA_OBJS)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(B)/lib/libnormproto.a: $(PROTO_OBJS)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

# ---- products ----------------------------------------------------------------
$(B)/bin/normd: $(DAEMON_OBJS) $(B)/lib/libnormkernels.a $(B)/lib/libnormproto.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $(DAEMON_OBJS) $(B)/lib/libnormkernels.a $(B)/lib/libnormproto.a \
		$(STATIC_UV) $(STATIC_PB) $(CUDART) $(SYS_LIBS) -lstdc++

$(B)/lib/libnormclient.a: $(CLIENT_OBJS) $(PROTO_OBJS) $(B)/obj/kernels/cuda_driver.o
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

# The real file carries the full version; the soname names the ABI
# (SOVERSION); libnormclient.so is the link-time name.
$(B)/lib/libnormclient.so.$(VERSION): $(CLIENT_PIC_OBJS) $(B)/obj/gen/normd.pb-c.o
	@mkdir -p $(dir $@)
	$(CC) -shared -Wl,-soname,libnormclient.so.$(SOVERSION) -Wl,--no-undefined $(LDFLAGS) \
		-o $@ $^ -lprotobuf-c $(CUDART) $(SYS_LIBS)

$(B)/lib/libnormclient.so: $(B)/lib/libnormclient.so.$(VERSION)
	ln -sf libnormclient.so.$(VERSION) $(B)/lib/libnormclient.so.$(SOVERSION)
	ln -sf libnormclient.so.$(SOVERSION) $@

# ---- the Python wheel ----------------------------------------------------------
# make wheel: $(WHEEL), the package of bindings/python with a libnormclient.so.0
# of its own inside (bindings/python/build_wheel.py writes it). That copy links
# protobuf-c and the CUDA runtime statically, so it needs only the C library
# (libcuda is opened with dlopen when a GPU is used) and the wheel installs and
# runs on a host with none of the build's packages. Debian's libprotobuf-c.a is
# built -fPIE: its code may go into a shared object when its symbols bind
# inside it, which --exclude-libs,ALL makes so (they are hidden, as the rest of
# the library's are; only nc_* is exported).
PYTHON ?= python3
WHEEL_PLATFORM := linux_$(shell uname -m)
WHEEL := $(B)/wheel/normd-$(VERSION)-py3-none-$(WHEEL_PLATFORM).whl
WHEEL_INPUTS := bindings/python/build_wheel.py bindings/python/pyproject.toml \
	bindings/python/README.md bindings/python/licenses/protobuf-c.txt \
	$(wildcard bindings/python/normd/*.py bindings/python/normd/*/*.py) \
	$(wildcard bindings/python/normd/csrc/*.cpp) client/include/normclient.h

.PHONY: wheel
wheel: $(WHEEL)

$(B)/wheel/lib/libnormclient.so.$(SOVERSION): $(CLIENT_PIC_OBJS) $(B)/obj/gen/normd.pb-c.o
	@mkdir -p $(dir $@)
	$(CC) -shared -Wl,-soname,libnormclient.so.$(SOVERSION) -Wl,--no-undefined \
		-Wl,--exclude-libs,ALL $(LDFLAGS) -o $@ $^ $(STATIC_PB) $(CUDART) $(SYS_LIBS)

$(WHEEL): $(B)/wheel/lib/libnormclient.so.$(SOVERSION) $(WHEEL_INPUTS)
	$(PYTHON) bindings/python/build_wheel.py --library $< --version $(VERSION) \
		--platform $(WHEEL_PLATFORM) --out $(B)/wheel

# The pkg-config file: paths under the prefix are written as ${prefix}/...
# so that `pkg-config --define-variable=prefix=...` can relocate them.
PC_SED = -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@VERSION@|$(VERSION)|g' \
	-e 's|@LIBDIR@|$(patsubst $(PREFIX)/%,$${prefix}/%,$(LIBDIR))|g' \
	-e 's|@INCLUDEDIR@|$(patsubst $(PREFIX)/%,$${prefix}/%,$(INCLUDEDIR))|g' \
	-e 's|@CUDA_LIBDIR@|$(CUDA_HOME)/lib64|g'
$(B)/lib/pkgconfig/normclient.pc: client/normclient.pc.in Makefile
	@mkdir -p $(dir $@)
	sed $(PC_SED) $< > $@

CLIENT_TOOL_LIBS := $(B)/lib/libnormclient.a $(B)/lib/libnormkernels.a $(STATIC_PB) \
	$(CUDART) $(SYS_LIBS) -lstdc++
TOOL_COMMON_OBJS := $(B)/obj/client/tools/jobkit.o $(B)/obj/client/tools/statsfmt.o
$(B)/bin/%: $(B)/obj/client/tools/%.o $(TOOL_COMMON_OBJS) $(B)/lib/libnormclient.a \
		$(B)/lib/libnormkernels.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $< $(TOOL_COMMON_OBJS) $(CLIENT_TOOL_LIBS)

# normstress is its engine (normstress.c) and its parts (client/tools/stress_*.c).
STRESS_OBJS := $(patsubst %.c,$(B)/obj/%.o,$(wildcard client/tools/stress_*.c))
$(B)/bin/normstress: $(B)/obj/client/tools/normstress.o $(STRESS_OBJS) $(TOOL_COMMON_OBJS) \
		$(B)/lib/libnormclient.a $(B)/lib/libnormkernels.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $< $(STRESS_OBJS) $(TOOL_COMMON_OBJS) $(CLIENT_TOOL_LIBS)

# ---- tests -------------------------------------------------------------------
# Every tests/{unit,integration}/test_*.c is one program; the runner starts
# each in its own process with a timeout (tests/run.sh).
UNIT_TESTS := $(patsubst tests/unit/%.c,$(B)/tests/unit/%,$(wildcard tests/unit/test_*.c))
INTEG_TESTS := $(patsubst tests/integration/%.c,$(B)/tests/integration/%,\
	$(wildcard tests/integration/test_*.c))
GPU_TESTS := $(patsubst tests/gpu/%.c,$(B)/tests/gpu/%,$(wildcard tests/gpu/test_*.c))
TEST_SUPPORT_OBJS := $(patsubst %.c,$(B)/obj/%.o,$(wildcard tests/support/*.c))
TEST_LIBS := $(TEST_SUPPORT_OBJS) $(TOOL_COMMON_OBJS) $(B)/lib/libnormclient.a $(B)/lib/libnormkernels.a \
	$(B)/lib/libnormproto.a $(STATIC_PB) $(STATIC_UV) -lcmocka $(CUDART) $(SYS_LIBS) -lstdc++

.PHONY: tests
tests: $(UNIT_TESTS) $(INTEG_TESTS)

$(B)/tests/%: $(B)/obj/tests/%.o $(TEST_SUPPORT_OBJS) $(TOOL_COMMON_OBJS) $(B)/lib/libnormclient.a \
		$(B)/lib/libnormkernels.a $(B)/lib/libnormproto.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $< $(TEST_LIBS)

# ---- GPU programs (built here, run on the GPU machine) -----------------------
BENCH_PROGS := $(patsubst bench/%.c,$(B)/bench/%,$(wildcard bench/*.c))
$(B)/bench/%: $(B)/obj/bench/%.o $(TEST_SUPPORT_OBJS) $(TOOL_COMMON_OBJS) $(B)/lib/libnormclient.a \
		$(B)/lib/libnormkernels.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $< $(TEST_LIBS)

.PHONY: gpu-progs
gpu-progs: all $(GPU_TESTS) $(BENCH_PROGS) $(B)/lib/gpu-host/libprotobuf-c.so.1 \
	$(B)/lib/gpu-host/libcmocka.so.0

# The GPU machine has no Debian packages: the shared libraries our programs
# load there (libprotobuf-c for libnormclient.so, libcmocka for the tests)
# travel in build/lib/gpu-host; tests/gpu/run.sh and bench/run.sh put it on
# LD_LIBRARY_PATH.
$(B)/lib/gpu-host/%:
	@mkdir -p $(dir $@)
	cp -L "$$(ldconfig -p | awk '/$* .*x86-64/ {print $$NF; exit}')" $@

# ---- sanitizers and fuzzing ---------------------------------------------------
# The same sources built again into $(B)/asan (AddressSanitizer + UBSan, gcc)
# and $(B)/fuzz (libFuzzer + ASan + UBSan, clang) by a recursive make with
# B and the flags overridden. The CUDA kernel objects (nvcc, which takes no
# sanitizer) are built once in $(B) and linked into both. gcc's pointer-overflow
# check makes the CPU kernels ten times slower (minutes of test time) and
# guards nothing the bounds checks rely on (they compute in integers); the
# fuzz build, with clang, keeps it.
SAN_FLAGS := -fsanitize=address,undefined -fno-sanitize=pointer-overflow \
	-fno-omit-frame-pointer -fno-sanitize-recover=all
FUZZ_FLAGS := -fsanitize=fuzzer-no-link,address,undefined -fno-omit-frame-pointer \
	-fno-sanitize-recover=all
FUZZ_LDFLAGS := -fsanitize=fuzzer,address,undefined
ASAN_B := $(B)/asan
FUZZ_B := $(B)/fuzz
FUZZ_SECONDS ?= 300
SUB_MAKE = $(MAKE) --no-print-directory KERNEL_CUDA_OBJS="$(KERNEL_CUDA_OBJS)"

# The fuzz target links the daemon without its main() (tests/fuzz/fuzz_frame.c).
FUZZ_DAEMON_OBJS = $(filter-out $(B)/obj/daemon/main.o,$(DAEMON_OBJS))
$(B)/fuzz_frame: $(B)/obj/tests/fuzz/fuzz_frame.o $(FUZZ_DAEMON_OBJS) $(B)/lib/libnormkernels.a \
		$(B)/lib/libnormproto.a
	$(CC) $(LDFLAGS) -o $@ $^ $(STATIC_UV) $(STATIC_PB) $(CUDART) $(SYS_LIBS) -lstdc++

.PHONY: asan fuzz-build fuzz-corpus
asan: $(KERNEL_CUDA_OBJS)
	+@$(SUB_MAKE) B=$(ASAN_B) EXTRA_CFLAGS="$(SAN_FLAGS)" LDFLAGS="$(SAN_FLAGS)" \
		$(ASAN_B)/bin/normd $(ASAN_B)/bin/normctl tests

fuzz-build: $(KERNEL_CUDA_OBJS)
	+@$(SUB_MAKE) B=$(FUZZ_B) CC=clang EXTRA_CFLAGS="$(FUZZ_FLAGS)" LDFLAGS="$(FUZZ_LDFLAGS)" \
		$(FUZZ_B)/fuzz_frame

# Regenerates the committed seed corpus (tests/fuzz/gen_corpus.c).
fuzz-corpus: $(B)/tests/fuzz/gen_corpus
	@mkdir -p tests/fuzz/corpus
	$(B)/tests/fuzz/gen_corpus tests/fuzz/corpus

# ---- entry points ------------------------------------------------------------
deps:
	@sh tests/install-deps.sh

run: deps
	@$(MAKE) --no-print-directory -j$$(nproc) all
	@sh tests/run-demo.sh $(B)

# bench_norm too: tests/python/test_bench_peers.py checks its byte accounting (--plan).
test: deps
	@$(MAKE) --no-print-directory -j$$(nproc) all asan fuzz-build wheel $(B)/bench/bench_norm
	@sh tests/run.sh $(B)

# The unit and integration tests and the demo, built with ASan + UBSan.
test-asan: deps
	@$(MAKE) --no-print-directory -j$$(nproc) asan
	@NORMD_SUITES=asan sh tests/run.sh $(B)

# Fuzzes the frame decoder and request validation for FUZZ_SECONDS (default 300).
fuzz: deps
	@$(MAKE) --no-print-directory -j$$(nproc) fuzz-build
	@sh tests/fuzz/run.sh $(FUZZ_B)/fuzz_frame $(FUZZ_SECONDS)

test-gpu: gpu-progs
	@sh tests/gpu/run.sh $(B)

# bench_peers exits 1 when a peer's cell failed or its check did not pass; the
# benchmarks after it still run ("-").
bench-gpu: gpu-progs
	@sh bench/run.sh $(B)
	-@LD_LIBRARY_PATH=$(B)/lib/gpu-host python3 bench/bench_peers.py --build $(B) \
		--json $${BENCH_LOG_DIR:-/tmp}/bench_peers.json
	@LD_LIBRARY_PATH=$(B)/lib/gpu-host $(B)/bench/bench_latency
	@LD_LIBRARY_PATH=$(B)/lib/gpu-host python3 bench/bench_wgrad.py $(B)
	@LD_LIBRARY_PATH=$(B)/lib/gpu-host python3 bench/bench_host_path.py --build $(B) \
		--json $${BENCH_LOG_DIR:-/tmp}/bench_host_path.json
	@LD_LIBRARY_PATH=$(B)/lib/gpu-host python3 bench/bench_train.py --build $(B) --mps \
		--json $${BENCH_LOG_DIR:-/tmp}/bench_train.json
	@LD_LIBRARY_PATH=$(B)/lib/gpu-host python3 bench/compiled_kernels.py --build $(B)
	@sh bench/multi_gpu.sh $${BENCH_LOG_DIR:-/tmp}/multi_gpu $(B)

# ---- install -------------------------------------------------------------------
# make install [PREFIX=/usr/local] [DESTDIR=staging root]: binaries (normd in
# sbin), the client library (.so with its soname links, .a), the header and
# pkg-config file, systemd units (written from their templates with these
# paths), sysusers.d/tmpfiles.d files, man pages, and the default config
# file unless one is already there. Run ldconfig afterwards for /usr/local.
INSTALL ?= install
# The NVIDIA driver installs the MPS control program (normd-mps@.service).
MPS_CONTROL ?= /usr/bin/nvidia-cuda-mps-control
UNIT_SED = -e 's|@SBINDIR@|$(SBINDIR)|g' -e 's|@SYSCONFDIR@|$(SYSCONFDIR)|g' \
	-e 's|@MPS_CONTROL@|$(MPS_CONTROL)|g'
D := $(DESTDIR)

install: all
	@mkdir -p $(B)/install
	sed $(PC_SED) client/normclient.pc.in > $(B)/install/normclient.pc
	sed $(UNIT_SED) systemd/normd@.service.in > $(B)/install/normd@.service
	sed $(UNIT_SED) systemd/normd-mps@.service.in > $(B)/install/normd-mps@.service
	$(INSTALL) -d $(D)$(BINDIR) $(D)$(SBINDIR) $(D)$(LIBDIR)/pkgconfig $(D)$(INCLUDEDIR) \
		$(D)$(UNITDIR) $(D)$(SYSUSERSDIR) $(D)$(TMPFILESDIR) $(D)$(SYSCONFDIR)/normd \
		$(D)$(MANDIR)/man1 $(D)$(MANDIR)/man3 $(D)$(MANDIR)/man8
	$(INSTALL) -m 0755 $(B)/bin/normd $(D)$(SBINDIR)/normd
	$(INSTALL) -m 0755 $(B)/bin/normctl $(B)/bin/normstress $(D)$(BINDIR)/
	$(INSTALL) -m 0755 $(B)/lib/libnormclient.so.$(VERSION) $(D)$(LIBDIR)/
	ln -sf libnormclient.so.$(VERSION) $(D)$(LIBDIR)/libnormclient.so.$(SOVERSION)
	ln -sf libnormclient.so.$(SOVERSION) $(D)$(LIBDIR)/libnormclient.so
	$(INSTALL) -m 0644 $(B)/lib/libnormclient.a $(D)$(LIBDIR)/
	$(INSTALL) -m 0644 $(B)/install/normclient.pc $(D)$(LIBDIR)/pkgconfig/
	$(INSTALL) -m 0644 client/include/normclient.h $(D)$(INCLUDEDIR)/
	$(INSTALL) -m 0644 $(B)/install/normd@.service systemd/normd@.socket \
		$(B)/install/normd-mps@.service $(D)$(UNITDIR)/
	$(INSTALL) -m 0644 systemd/normd.sysusers $(D)$(SYSUSERSDIR)/normd.conf
	$(INSTALL) -m 0644 systemd/normd.tmpfiles $(D)$(TMPFILESDIR)/normd.conf
	$(INSTALL) -m 0644 man/normctl.1 man/normstress.1 $(D)$(MANDIR)/man1/
	$(INSTALL) -m 0644 man/libnormclient.3 $(D)$(MANDIR)/man3/
	$(INSTALL) -m 0644 man/normd.8 $(D)$(MANDIR)/man8/
	@if [ -e $(D)$(SYSCONFDIR)/normd/normd.conf ]; then \
		echo "keeping $(D)$(SYSCONFDIR)/normd/normd.conf (the new default is systemd/normd.conf)"; \
	else \
		echo "$(INSTALL) -m 0644 systemd/normd.conf $(D)$(SYSCONFDIR)/normd/normd.conf"; \
		$(INSTALL) -m 0644 systemd/normd.conf $(D)$(SYSCONFDIR)/normd/normd.conf; \
	fi

# Removes what install put there, except the config file (it may be edited).
uninstall:
	rm -f $(D)$(SBINDIR)/normd $(D)$(BINDIR)/normctl $(D)$(BINDIR)/normstress \
		$(D)$(LIBDIR)/libnormclient.so.$(VERSION) $(D)$(LIBDIR)/libnormclient.so.$(SOVERSION) \
		$(D)$(LIBDIR)/libnormclient.so $(D)$(LIBDIR)/libnormclient.a \
		$(D)$(LIBDIR)/pkgconfig/normclient.pc $(D)$(INCLUDEDIR)/normclient.h \
		$(D)$(UNITDIR)/normd@.service $(D)$(UNITDIR)/normd@.socket \
		$(D)$(UNITDIR)/normd-mps@.service \
		$(D)$(SYSUSERSDIR)/normd.conf $(D)$(TMPFILESDIR)/normd.conf \
		$(D)$(MANDIR)/man1/normctl.1 $(D)$(MANDIR)/man1/normstress.1 \
		$(D)$(MANDIR)/man3/libnormclient.3 $(D)$(MANDIR)/man8/normd.8

clean:
	rm -rf $(B)

-include $(shell find $(B)/obj $(B)/pic -name '*.d' 2>/dev/null)
