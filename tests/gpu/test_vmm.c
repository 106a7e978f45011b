/*
 * VMM memory end to end (run on the GPU machine by `make test-gpu`): tensors
 * in cuMemCreate chunks (POSIX fd handle type) mapped back to back, as
 * PyTorch's expandable segments are, registered as CUDA_VMM_FD regions:
 * - every op (LayerNorm/RMSNorm forward and backward, f32 and bf16, affine
 *   and memory-efficient) on tensors that straddle chunk boundaries, in the
 *   sync, enqueue (nc_job_enqueue and nc_job_enqueue_device) and event
 *   modes, against the float64 reference (jobkit: random non-zero inputs,
 *   outputs poisoned with NaN first);
 * - an explicit region over several chunks (nc_region_register_device_range);
 * - a chunk unmapped and created again at the same address: the library
 *   registers it anew (a new region id, the old region swept) and the job
 *   reads the new memory, not the stale registration's;
 * - VMM memory without the POSIX fd handle type, a range running into
 *   unmapped addresses and one over more than NC_VMM_MAX_CHUNKS chunks are
 *   refused with a message;
 * - the daemon's free device memory is back to its baseline once a client
 *   that registered VMM memory and ran jobs on it (all modes) disconnects.
 *
 * Every CUDA call happens in a child process (tests/gpu/gpu_test.h). The
 * driver's VMM calls are reached through cudaGetDriverEntryPointByVersion,
 * as the library does: nothing links libcuda.
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client/tools/jobkit.h"
#include "normclient.h"
#include "tests/gpu/gpu_test.h"
#include "tests/support/testlib.h"

static struct test_daemon daemon_;

/* ---- the driver's VMM calls ------------------------------------------------------ */

static struct {
	CUresult (*create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
			   unsigned long long);
	CUresult (*release)(CUmemGenericAllocationHandle);
	CUresult (*reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
	CUresult (*free)(CUdeviceptr, size_t);
	CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
			unsigned long long);
	CUresult (*unmap)(CUdeviceptr, size_t);
	CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
	CUresult (*granularity)(size_t *, const CUmemAllocationProp *,
				CUmemAllocationGranularity_flags);
} cu;

static int cu_lookup(void)
{
	static const char *const names[] = {
		"cuMemCreate", "cuMemRelease", "cuMemAddressReserve", "cuMemAddressFree",
		"cuMemMap",    "cuMemUnmap",   "cuMemSetAccess",      "cuMemGetAllocationGranularity",
	};
	void **slots[] = {(void **)&cu.create, (void **)&cu.release, (void **)&cu.reserve,
			  (void **)&cu.free,   (void **)&cu.map,     (void **)&cu.unmap,
			  (void **)&cu.set_access, (void **)&cu.granularity};
	if (cudaSetDevice(0) != cudaSuccess || cudaFree(NULL) != cudaSuccess)
		return -1;
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
		enum cudaDriverEntryPointQueryResult status;
		if (cudaGetDriverEntryPointByVersion(names[i], slots[i], 12000, cudaEnableDefault,
						     &status) != cudaSuccess ||
		    status != cudaDriverEntryPointSuccess || !*slots[i]) {
			fprintf(stderr, "  no driver entry point %s\n", names[i]);
			return -1;
		}
	}
	return 0;
}

static CUmemAllocationProp chunk_prop(bool exportable)
{
	CUmemAllocationProp prop;
	memset(&prop, 0, sizeof(prop));
	prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
	prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	prop.location.id = 0;
	prop.requestedHandleTypes = exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
					       : CU_MEM_HANDLE_TYPE_NONE;
	return prop;
}

/* VMM memory as expandable segments make it: `mapped` chunks of `chunk` bytes from base. */
#define VMM_MAX 80
struct vmm {
	CUdeviceptr base;
	size_t chunk, reserved;          /* bytes of one chunk; of the reservation */
	unsigned mapped;
	CUmemGenericAllocationHandle handles[VMM_MAX];
};

static size_t vmm_granularity(void)
{
	CUmemAllocationProp prop = chunk_prop(true);
	size_t g = 0;
	return cu.granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) == CUDA_SUCCESS ? g : 0;
}

/* Creates chunk i and maps it at its place (read/write for device 0). */
static int vmm_map_chunk(struct vmm *v, unsigned i, bool exportable)
{
	CUmemAllocationProp prop = chunk_prop(exportable);
	CUdeviceptr at = v->base + (CUdeviceptr)i * v->chunk;
	CUmemAccessDesc access;
	memset(&access, 0, sizeof(access));
	access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	access.location.id = 0;
	access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
	if (cu.create(&v->handles[i], v->chunk, &prop, 0) != CUDA_SUCCESS)
		return -1;
	if (cu.map(at, v->chunk, 0, v->handles[i], 0) != CUDA_SUCCESS ||
	    cu.set_access(at, v->chunk, &access, 1) != CUDA_SUCCESS) {
		cu.release(v->handles[i]);
		return -1;
	}
	return 0;
}

/* Reserves room for `reserve` chunks and maps the first `mapped`. */
static int vmm_create(struct vmm *v, unsigned mapped, unsigned reserve, bool exportable)
{
	memset(v, 0, sizeof(*v));
	v->chunk = vmm_granularity();
	v->reserved = v->chunk * reserve;
	if (v->chunk == 0 || reserve > VMM_MAX ||
	    cu.reserve(&v->base, v->reserved, v->chunk, 0, 0) != CUDA_SUCCESS)
		return -1;
	for (; v->mapped < mapped; v->mapped++) {
		if (vmm_map_chunk(v, v->mapped, exportable) != 0)
			return -1;
	}
	return 0;
}

static void vmm_unmap_chunk(struct vmm *v, unsigned i)
{
	cu.unmap(v->base + (CUdeviceptr)i * v->chunk, v->chunk);
	cu.release(v->handles[i]);
}

static void vmm_destroy(struct vmm *v)
{
	cudaDeviceSynchronize();
	for (unsigned i = 0; i < v->mapped; i++)
		vmm_unmap_chunk(v, i);
	if (v->base)
		cu.free(v->base, v->reserved);
	memset(v, 0, sizeof(*v));
}

/* ---- jobs -------------------------------------------------------------------------- */

enum mode { SYNC, ENQUEUE, ENQUEUE_DEVICE, EVENT };
static const char *const mode_names[] = {"sync", "enqueue", "enqueue_device", "event"};

/* Runs the kit's job in `mode` on `stream` and waits for it. */
static int run_in_mode(nc_conn *conn, struct jobkit *kit, enum mode mode, cudaStream_t stream,
		       char *message, size_t len)
{
	struct nc_job_result result;
	memset(&result, 0, sizeof(result));
	int rc = 0;
	if (mode == SYNC) {
		rc = nc_job_run_on_stream(conn, &kit->job, stream, 30000, &result);
	} else if (mode == EVENT) {
		rc = nc_job_run_event(conn, &kit->job, stream, 30000, &result);
	} else if (mode == ENQUEUE) {
		rc = nc_job_enqueue(conn, &kit->job, stream);
	} else {
		const void *ptrs[NC_JOB_TENSORS] = {0};
		for (int role = 0; role < NC_JOB_TENSORS; role++) {
			if (kit->ptr[role])
				ptrs[role] = (char *)kit->device_base +
					     ((char *)kit->ptr[role] - (char *)kit->staging);
		}
		/* Every tensor from ptrs[]: none of the kit's resolved ones is kept. */
		struct nc_job job = kit->job;
		struct nc_tensor none = {0, 0};
		job.x = job.y = job.mean = job.rstd = job.gamma = job.beta = none;
		job.dy = job.dx = job.dgamma = job.dbeta = none;
		rc = nc_job_enqueue_device(conn, &job, ptrs, stream);
	}
	if (rc == 0 && cudaStreamSynchronize(stream) != cudaSuccess)
		rc = NC_EDEVICE_ERROR;
	if (rc == 0 && (mode == ENQUEUE || mode == ENQUEUE_DEVICE))
		rc = nc_conn_check(conn, 30000);
	snprintf(message, len, "%s", rc ? (result.message[0] ? result.message : nc_last_error())
				       : "");
	return rc;
}

/* One job at `memory` (VMM), run in `mode`, checked against the reference. */
static int vmm_job(nc_conn *conn, const struct jobkit_spec *spec, enum mode mode,
		   cudaStream_t stream)
{
	struct jobkit kit;
	struct jobkit_report rep = {0};
	char message[256];
	int rc = jobkit_create(conn, spec, &kit);
	if (rc) {
		fprintf(stderr, "  set-up (%s): %s\n", mode_names[mode], nc_last_error());
		return 1;
	}
	rc = run_in_mode(conn, &kit, mode, stream, message, sizeof(message));
	bool ok = rc == NC_OK && jobkit_check(&kit, &rep);
	if (!ok)
		fprintf(stderr, "  %s %s %llux%llu dtype %s me %d: %s (%s) %s\n", mode_names[mode],
			jobkit_op_name(spec->op), (unsigned long long)spec->rows,
			(unsigned long long)spec->cols, jobkit_dtype_name(spec->dtype),
			spec->memory_efficient, nc_status_name(rc), message, rep.detail);
	jobkit_destroy(&kit);
	return ok ? 0 : 1;
}

/* The specs of the matrix: every op, f32 and bf16, each tensor a few chunks long. */
static int spec_matrix(struct jobkit_spec *specs, size_t max, void *memory, size_t chunk)
{
	int n = 0;
	for (int op = 1; op <= 4; op++)
		for (int dt = 0; dt < 2; dt++)
			for (int me = 0; me < 2 && (size_t)n < max; me++) {
				bool bwd = op == 2 || op == 4;
				if (me && !bwd)
					continue;
				enum nc_dtype dtype = dt ? NC_BF16 : NC_F32;
				/* x alone spans about 1.5 chunks: every tensor crosses a boundary. */
				uint64_t cols = 1536;
				uint64_t rows = (chunk * 3 / 2) / (cols * (dtype == NC_F32 ? 4 : 2));
				specs[n++] = (struct jobkit_spec){
					.op = (enum nc_op)op, .rows = rows, .cols = cols,
					.dtype = dtype, .gamma = true, .beta = op <= 2,
					.memory_efficient = me, .seed = (uint64_t)(100 + n),
					.on_device = true, .device_memory = memory,
				};
			}
	return n;
}

/* Every op in every mode, the tensors starting mid-chunk and crossing boundaries. */
static int every_op_every_mode(void *arg)
{
	(void)arg;
	CHECK(cu_lookup() == 0, "driver entry points");
	struct vmm v;
	CHECK(vmm_create(&v, 16, 16, true) == 0, "cannot create 16 VMM chunks");
	/* 1 KiB + 48 bytes before the middle of chunk 0: no tensor starts at a chunk. */
	char *memory = (char *)(uintptr_t)v.base + v.chunk / 2 + 1072;
	struct jobkit_spec specs[16];
	int n = spec_matrix(specs, 16, memory, v.chunk);
	size_t need = 0;
	for (int i = 0; i < n; i++)
		need = jobkit_bytes(&specs[i]) > need ? jobkit_bytes(&specs[i]) : need;
	CHECK(need + v.chunk / 2 + 1072 <= v.reserved, "layout needs %zu bytes", need);
	nc_conn *conn = gpu_test_connect(daemon_.socket, "vmm-every-op");
	CHECK(conn, "no connection");
	cudaStream_t stream;
	CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess, "stream");
	int bad = 0, jobs = 0;
	for (int mode = SYNC; mode <= EVENT; mode++)
		for (int i = 0; i < n; i++, jobs++)
			bad += vmm_job(conn, &specs[i], (enum mode)mode, stream);
	printf("  %d jobs on %zu-byte chunks, tensors from chunk offset %zu, %d wrong\n", jobs,
	       v.chunk, v.chunk / 2 + 1072, bad);
	cudaStreamDestroy(stream);
	nc_close(conn);
	vmm_destroy(&v);
	CHECK(bad == 0, "%d of %d jobs wrong", bad, jobs);
	return 0;
}

/* One explicit region over 5 chunks; a job on it through nc_tensor_at. */
static int explicit_region(void *arg)
{
	(void)arg;
	CHECK(cu_lookup() == 0, "driver entry points");
	struct vmm v;
	CHECK(vmm_create(&v, 6, 6, true) == 0, "cannot create VMM chunks");
	nc_conn *conn = gpu_test_connect(daemon_.socket, "vmm-explicit");
	CHECK(conn, "no connection");
	nc_region *region = NULL;
	char *start = (char *)(uintptr_t)v.base + v.chunk + 4096; /* inside chunk 1 */
	int rc = nc_region_register_device_range(conn, start, 3 * v.chunk, &region);
	CHECK(rc == NC_OK, "register: %s", nc_last_error());
	/* [chunk 1 + 4 KiB, + 3 chunks) touches chunks 1 to 4. */
	CHECK(nc_region_data(region) == (void *)(uintptr_t)(v.base + v.chunk) &&
		      nc_region_size(region) == 4 * v.chunk,
	      "region at %p of %zu bytes", nc_region_data(region), nc_region_size(region));
	/* y = RMSNorm(x) with x and y each 1.5 chunks, named from the region. */
	uint64_t cols = 4096, rows = v.chunk * 3 / 2 / (cols * 4);
	char *x = start, *y = start + rows * cols * 4 + 256;
	float *host = malloc(rows * cols * 4);
	CHECK(host, "memory");
	for (uint64_t i = 0; i < rows * cols; i++)
		host[i] = (float)((i * 7919) % 1000) / 250.0f - 2.0f + 0.001f;
	CHECK(cudaMemcpy(x, host, rows * cols * 4, cudaMemcpyHostToDevice) == cudaSuccess &&
		      cudaMemset(y, 0xff, rows * cols * 4) == cudaSuccess,
	      "upload");
	struct nc_job job = {.op = NC_RMSNORM_FWD, .rows = rows, .cols = cols, .dtype = NC_F32,
			     .x = nc_tensor_at(region, x), .y = nc_tensor_at(region, y)};
	struct nc_job_result result;
	rc = nc_job_run_on_stream(conn, &job, NULL, 30000, &result);
	CHECK(rc == NC_OK, "job: %s", result.message);
	float *out = malloc(rows * cols * 4);
	CHECK(out && cudaMemcpy(out, y, rows * cols * 4, cudaMemcpyDeviceToHost) == cudaSuccess,
	      "download");
	double worst = 0;
	for (uint64_t r = 0; r < rows; r++) {
		double ss = 0;
		for (uint64_t c = 0; c < cols; c++)
			ss += (double)host[r * cols + c] * host[r * cols + c];
		double rstd = 1.0 / sqrt(ss / (double)cols + 1e-5);
		for (uint64_t c = 0; c < cols; c++) {
			double want = host[r * cols + c] * rstd, got = out[r * cols + c];
			double err = got != got ? 1e9 : fabs(got - want) / (1.0 + fabs(want));
			worst = err > worst ? err : worst;
		}
	}
	free(host);
	free(out);
	CHECK(nc_region_free(region) == NC_OK, "free: %s", nc_last_error());
	nc_close(conn);
	vmm_destroy(&v);
	CHECK(worst < 1e-5, "worst relative error %g", worst);
	return 0;
}

/* Daemon-wide regions (this test's child is the only client). */
static int daemon_regions(unsigned *regions)
{
	struct nc_stats stats;
	int rc = gpu_test_stats(daemon_.socket, &stats);
	*regions = stats.regions;
	return rc;
}

/*
 * Chunk 1 unmapped and a new allocation mapped at the same address: the
 * cached registration of chunks 0-2 must not serve it (the daemon's import
 * still holds the old memory), so the tensor gets a new region, the old one
 * is unregistered, and the job reads the new memory's values.
 */
static int remapped_chunk(void *arg)
{
	(void)arg;
	CHECK(cu_lookup() == 0, "driver entry points");
	struct vmm v;
	CHECK(vmm_create(&v, 3, 3, true) == 0, "cannot create VMM chunks");
	nc_conn *conn = gpu_test_connect(daemon_.socket, "vmm-remap");
	CHECK(conn, "no connection");
	/* x over chunks 0-1 (from mid chunk 0), y right behind it over chunks 1-2. */
	uint64_t cols = 1024, rows = v.chunk / (cols * 4) + 8;
	size_t bytes = rows * cols * 4;
	char *x = (char *)(uintptr_t)v.base + v.chunk / 2, *y = x + bytes;
	CHECK(y + bytes <= (char *)(uintptr_t)(v.base + 3 * v.chunk), "layout");
	float *host = malloc(bytes), *out = malloc(bytes);
	CHECK(host && out, "memory");
	unsigned base_regions = 0;
	CHECK(daemon_regions(&base_regions) == 0, "stats");
	uint64_t first_region = 0;
	for (int round = 0; round < 2; round++) {
		/* Round 1: chunk 1 holds the middle of x; it is replaced before the job. */
		if (round == 1) {
			cudaDeviceSynchronize();
			vmm_unmap_chunk(&v, 1);
			CHECK(vmm_map_chunk(&v, 1, true) == 0, "remap chunk 1");
		}
		for (uint64_t i = 0; i < rows * cols; i++)
			host[i] = (float)(((i + 13 * (uint64_t)round) * 2654435761u) % 2000) / 500.0f -
				  2.0f + 0.0007f * (float)(round + 1);
		CHECK(cudaMemcpy(x, host, bytes, cudaMemcpyHostToDevice) == cudaSuccess &&
			      cudaMemset(y, 0xff, bytes) == cudaSuccess &&
			      cudaDeviceSynchronize() == cudaSuccess,
		      "upload");
		struct nc_job job = {.op = NC_LAYERNORM_FWD, .rows = rows, .cols = cols,
				     .dtype = NC_F32};
		CHECK(nc_tensor_device_range(conn, x, bytes, &job.x) == NC_OK &&
			      nc_tensor_device_range(conn, y, bytes, &job.y) == NC_OK,
		      "tensors: %s", nc_last_error());
		if (round == 0)
			first_region = job.x.region;
		else
			CHECK(job.x.region != first_region,
			      "the remapped chunk was served from region %llu, registered before",
			      (unsigned long long)first_region);
		struct nc_job_result result;
		int rc = nc_job_run_on_stream(conn, &job, NULL, 30000, &result);
		CHECK(rc == NC_OK, "round %d: %s", round, result.message);
		CHECK(cudaMemcpy(out, y, bytes, cudaMemcpyDeviceToHost) == cudaSuccess, "download");
		double worst = 0;
		for (uint64_t r = 0; r < rows; r++) {
			double sum = 0, sq = 0;
			for (uint64_t c = 0; c < cols; c++)
				sum += host[r * cols + c];
			double mean = sum / (double)cols;
			for (uint64_t c = 0; c < cols; c++)
				sq += (host[r * cols + c] - mean) * (host[r * cols + c] - mean);
			double rstd = 1.0 / sqrt(sq / (double)cols + 1e-5);
			for (uint64_t c = 0; c < cols; c++) {
				double want = (host[r * cols + c] - mean) * rstd;
				double got = out[r * cols + c];
				double err = got != got ? 1e9 : fabs(got - want) / (1.0 + fabs(want));
				worst = err > worst ? err : worst;
			}
		}
		CHECK(worst < 1e-5, "round %d: worst relative error %g (stale memory read?)", round,
		      worst);
	}
	/*
	 * Round 0 registered chunks {0, 1, 2} for x (its own, grown over the
	 * mapped neighbours), which served y too; round 1's x found chunk 1
	 * changed and registered {0, 1', 2}. The stale region is unregistered
	 * once it has not been given out for 100 ms, at a later lookup.
	 */
	usleep(250000);
	struct nc_tensor again;
	CHECK(nc_tensor_device_range(conn, y, bytes, &again) == NC_OK, "y again: %s",
	      nc_last_error());
	CHECK(again.region != first_region, "y served from the stale region");
	unsigned regions = 0;
	CHECK(daemon_regions(&regions) == 0, "stats");
	CHECK(regions == base_regions + 1, "%u regions registered, expected %u", regions,
	      base_regions + 1);
	printf("  region %llu stale after the remap; a new one served the job\n",
	       (unsigned long long)first_region);
	free(host);
	free(out);
	nc_close(conn);
	vmm_destroy(&v);
	return 0;
}

/* What cannot be registered is refused with a message, and nothing is left registered. */
static int refused(void *arg)
{
	(void)arg;
	CHECK(cu_lookup() == 0, "driver entry points");
	nc_conn *conn = gpu_test_connect(daemon_.socket, "vmm-refused");
	CHECK(conn, "no connection");
	struct nc_tensor t;
	/* No POSIX fd handle type: cannot be exported. */
	struct vmm plain;
	CHECK(vmm_create(&plain, 2, 2, false) == 0, "cannot create plain VMM chunks");
	int rc = nc_tensor_device_range(conn, (void *)(uintptr_t)plain.base, 4096, &t);
	printf("  no fd handle type: %s: %s\n", nc_status_name(rc), nc_last_error());
	CHECK(rc == NC_EUNSUPPORTED && strstr(nc_last_error(), "POSIX file descriptor"),
	      "got %s: %s", nc_status_name(rc), nc_last_error());
	vmm_destroy(&plain);
	/* Two chunks mapped of four reserved: a range into the third runs into nothing. */
	struct vmm part;
	CHECK(vmm_create(&part, 2, 4, true) == 0, "cannot create VMM chunks");
	rc = nc_tensor_device_range(conn, (void *)(uintptr_t)(part.base + part.chunk),
				    part.chunk + 16, &t);
	printf("  into unmapped addresses: %s: %s\n", nc_status_name(rc), nc_last_error());
	CHECK(rc == NC_EINVALID_ARGUMENT && strstr(nc_last_error(), "not mapped"), "got %s: %s",
	      nc_status_name(rc), nc_last_error());
	vmm_destroy(&part);
	/* 65 chunks: one more than a region may have. */
	struct vmm many;
	CHECK(vmm_create(&many, NC_VMM_MAX_CHUNKS + 1, NC_VMM_MAX_CHUNKS + 1, true) == 0,
	      "cannot create %d chunks", NC_VMM_MAX_CHUNKS + 1);
	rc = nc_tensor_device_range(conn, (void *)(uintptr_t)many.base, many.reserved, &t);
	printf("  65 chunks: %s: %s\n", nc_status_name(rc), nc_last_error());
	CHECK(rc == NC_EUNSUPPORTED && strstr(nc_last_error(), "more than 64"), "got %s: %s",
	      nc_status_name(rc), nc_last_error());
	/* 64 are fine. */
	rc = nc_tensor_device_range(conn, (void *)(uintptr_t)many.base,
				    many.reserved - many.chunk, &t);
	CHECK(rc == NC_OK, "64 chunks: %s", nc_last_error());
	nc_close(conn);
	vmm_destroy(&many);
	return 0;
}

/* A client with VMM regions and jobs in every mode, leaving without unregistering. */
static int leaving_client(void *arg)
{
	(void)arg;
	if (cu_lookup() != 0)
		return 2;
	struct vmm v;
	if (vmm_create(&v, 16, 16, true) != 0)
		return 3;
	nc_conn *conn = gpu_test_connect(daemon_.socket, "vmm-leaving");
	cudaStream_t stream;
	if (!conn || cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess)
		return 4;
	struct jobkit_spec specs[16];
	char *memory = (char *)(uintptr_t)v.base + 4096;
	int n = spec_matrix(specs, 16, memory, v.chunk), bad = 0;
	for (int mode = SYNC; mode <= EVENT; mode++)
		for (int i = 0; i < n; i += 3)
			bad += vmm_job(conn, &specs[i], (enum mode)mode, stream);
	/* No nc_close: the process exits with its regions registered and its memory mapped. */
	return bad ? 5 : 0;
}

static int daemon_memory_returns(void *arg)
{
	(void)arg;
	/* The first run warms the daemon's workspaces and streams for these shapes. */
	CHECK(in_child(leaving_client, NULL) == 0, "warm-up client failed");
	CHECK(gpu_test_wait_idle(daemon_.socket) == 0, "daemon not idle after the warm-up");
	long long before = device_free_bytes();
	int rc = in_child(leaving_client, NULL);
	CHECK(rc == 0, "client failed (%d)", rc);
	CHECK(gpu_test_wait_idle(daemon_.socket) == 0, "regions of the client were not released");
	long long after = device_free_bytes();
	CHECK(before > 0 && after > 0, "cannot read device memory");
	printf("  device free memory before %lld MiB, after %lld MiB\n", before >> 20, after >> 20);
	CHECK(llabs(after - before) <= (8ll << 20), "device memory moved by %lld bytes",
	      after - before);
	return 0;
}

int main(void)
{
	if (test_daemon_start_on(&daemon_, "0", NULL) != 0) {
		fprintf(stderr, "cannot start normd --device 0\n");
		printf("test_vmm: 0 passed, 1 failed\n");
		return 1;
	}
	report("vmm: every op, every mode, across chunks", in_child(every_op_every_mode, NULL));
	report("vmm: explicit region over chunks", in_child(explicit_region, NULL));
	report("vmm: remapped chunk registered anew", in_child(remapped_chunk, NULL));
	report("vmm: unexportable and oversized refused", in_child(refused, NULL));
	report("vmm: daemon memory back after disconnect", daemon_memory_returns(NULL));
	bool alive = test_daemon_alive(&daemon_);
	if (gpu_tests_failed || !alive)
		test_daemon_dump_log(&daemon_);
	int rc = test_daemon_stop(&daemon_);
	report("daemon alive and exits 0 on SIGTERM", alive && rc == 0 ? 0 : 1);
	return gpu_test_summary("test_vmm");
}
