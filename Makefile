# normd: one entry point for building, testing, benchmarking and installing.
#
#   make            build everything into build/
#   make run        build, start normd on a private socket, run `normctl demo`, stop
#   make test       install missing build dependencies, build, run the whole suite
#   make test-gpu   GPU tests (on a machine with an NVIDIA GPU)
#   make bench-gpu  GPU benchmarks (on a machine with an NVIDIA GPU)
#
# Generated code goes to build/gen, objects to build/obj, products to
# build/bin, build/lib and build/tests. Nothing is written into the tree.

PREFIX ?= /usr/local
DESTDIR ?=
B := build
CUDA_HOME ?= /usr/local/cuda
NVCC ?= $(CUDA_HOME)/bin/nvcc
CC ?= cc
VERSION := 0.1.0

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

.PHONY: all run test test-unit test-asan test-gpu bench-gpu deps clean install fuzz
all: $(B)/bin/normd $(B)/bin/normctl $(B)/lib/libnormclient.a $(B)/lib/libnormclient.so \
	$(B)/lib/pkgconfig/normclient.pc tests

# ---- generated protocol code -------------------------------------------------
$(B)/gen/normd.pb-c.c $(B)/gen/normd.pb-c.h: proto/normd.proto
	@mkdir -p $(B)/gen
	protoc-c --proto_path=proto --c_out=$(B)/gen proto/normd.proto

# ---- objects -----------------------------------------------------------------
$(B)/obj/%.o: %.c | $(B)/gen/normd.pb-c.h
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -c $< -o $@

# Position-independent twins for the shared client library.
$(B)/pic/%.o: %.c | $(B)/gen/normd.pb-c.h
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -fPIC -c $< -o $@

$(B)/obj/gen/normd.pb-c.o: $(B)/gen/normd.pb-c.c
	@mkdir -p $(dir $@)
	$(CC) -std=c11 -O2 -g -fPIC -fvisibility=hidden -I$(B)/gen -c $< -o $@

$(B)/obj/kernels/%.cu.o: kernels/%.cu kernels/norm_kernels.h
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCC_FLAGS) -c $< -o $@

PROTO_OBJS := $(B)/obj/gen/normd.pb-c.o $(B)/obj/proto/frame.o
KERNEL_CPU_OBJS := $(B)/obj/kernels/norm_cpu.o $(B)/obj/kernels/norm_common.o \
	$(B)/obj/kernels/cuda_driver.o
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

$(B)/lib/libnormclient.so: $(CLIENT_PIC_OBJS) $(B)/obj/gen/normd.pb-c.o
	@mkdir -p $(dir $@)
	$(CC) -shared -Wl,-soname,libnormclient.so.0 -Wl,--no-undefined $(LDFLAGS) -o $@ $^ \
		-lprotobuf-c $(CUDART) $(SYS_LIBS)

$(B)/lib/pkgconfig/normclient.pc: client/normclient.pc.in Makefile
	@mkdir -p $(dir $@)
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@VERSION@|$(VERSION)|g' $< > $@

CLIENT_TOOL_LIBS := $(B)/lib/libnormclient.a $(B)/lib/libnormkernels.a $(STATIC_PB) \
	$(CUDART) $(SYS_LIBS) -lstdc++
TOOL_COMMON_OBJS := $(B)/obj/client/tools/jobkit.o
$(B)/bin/%: $(B)/obj/client/tools/%.o $(TOOL_COMMON_OBJS) $(B)/lib/libnormclient.a \
		$(B)/lib/libnormkernels.a
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) -o $@ $< $(TOOL_COMMON_OBJS) $(CLIENT_TOOL_LIBS)

# ---- tests -------------------------------------------------------------------
# Every tests/{unit,integration}/test_*.c is one program; the runner starts
# each in its own process with a timeout (tests/run.sh).
UNIT_TESTS := $(patsubst tests/unit/%.c,$(B)/tests/unit/%,$(wildcard tests/unit/test_*.c))
INTEG_TESTS := $(patsubst tests/integration/%.c,$(B)/tests/integration/%,\
	$(wildcard tests/integration/test_*.c))
GPU_TESTS := $(patsubst tests/gpu/%.c,$(B)/tests/gpu/%,$(wildcard tests/gpu/test_*.c))
TEST_SUPPORT_OBJS := $(patsubst %.c,$(B)/obj/%.o,$(wildcard tests/support/*.c))
TEST_LIBS := $(TEST_SUPPORT_OBJS) $(TOOL_COMMON_OBJS) $(B)/lib/libnormclient.a $(B)/lib/libnormkernels.a \
	$(B)/lib/libnormproto.a $(STATIC_PB) -lcmocka $(CUDART) $(SYS_LIBS) -lstdc++

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
gpu-progs: all $(GPU_TESTS) $(BENCH_PROGS)

# ---- entry points ------------------------------------------------------------
deps:
	@sh tests/install-deps.sh

run: deps
	@$(MAKE) --no-print-directory -j$$(nproc) all
	@sh tests/run-demo.sh $(B)

test: deps
	@$(MAKE) --no-print-directory -j$$(nproc) all
	@sh tests/run.sh $(B)

test-gpu: gpu-progs
	@sh tests/gpu/run.sh $(B)

bench-gpu: gpu-progs
	@sh bench/run.sh $(B)

clean:
	rm -rf $(B)

-include $(shell find $(B)/obj $(B)/pic -name '*.d' 2>/dev/null)
