/*
 * The CUDA backend: jobs on clients' own device memory, opened from CUDA IPC
 * handles, run by the kernels in kernels/norm_cuda*.cu.
 *
 * Per device: the primary context, a pool of worker threads each owning one
 * non-blocking stream, its scratch workspace and a pinned word for the
 * clamped-gamma count, one FIFO of jobs, and the device's variant cache. A
 * worker takes a job, picks its variant (cache, else rules or autotuning),
 * launches it, waits for its stream and hands the job back to the loop.
 *
 * Memory: each CUDA_IPC handle is opened once per connection (regions naming
 * the same handle bytes share one mapping), with lazy peer access, after
 * checking the claimed size against the real allocation; the mapping is
 * closed when the last region and job using it are gone. A CUDA_VMM_FD
 * region's chunks (cuMemCreate allocations exported as POSIX fds) are
 * imported and mapped back to back in an address reservation of the
 * region's own; the fds are closed at once, and the chunks are unmapped,
 * the reservation freed and the imported handles released when the last
 * job using the region is gone, as for IPC mappings.
 *
 * The enqueue mode (docs/ENQUEUE.md): each caller stream of a connection has
 * a stream of its own here, with its own workspace. Launcher threads
 * (enqueue_threads per device; a stream always goes to the same one, so its
 * jobs keep their order) watch each waiting job's ready word, which the
 * caller's GPU writes into host memory, and launch the job once it is set,
 * followed by the writes of the done word (in the client's device memory,
 * or in its memfd, which the daemon then registers with CUDA) and of a
 * pinned retired word the loop polls. No stream of the daemon ever waits on
 * a client: a GPU-side wait would block the hardware queue it shares with
 * other streams (32 at most), and with it other clients, and every
 * device-wide synchronization (cudaIpcCloseMemHandle is one). Launchers
 * never wait for the GPU.
 *
 * A failure while a kernel ran (illegal address, device lost) is sticky: it
 * poisons the context for everyone. The backend then fails every job with
 * DEVICE_ERROR and reports the cause through fatal_error(); the server sends
 * GoAway and exits non-zero so that systemd restarts it.
 */
#include "daemon/server.h"

#include <cuda_runtime_api.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "daemon/log.h"
#include "daemon/variant_cache.h"
#include "kernels/cuda_driver.h"
#include "proto/frame.h"

#define CUDA_MAX_WORKERS 64
#define CUDA_MAX_DEVICES 64
#define AUTOTUNE_CANDIDATES 16
#define AUTOTUNE_REPS 5
#define CUBLAS_WORKSPACE_BYTES (32u << 20)
#define DONE_EVENTS 32          /* per worker; reused round robin (see worker_early_reply) */
#define OPENED_EVENTS 256       /* clients' wait events kept open per device */
/*
 * A GPU-side wait on another process's event costs a switch between the two
 * contexts, about 300 us on an H100 (BENCHMARKS.md). So the event mode first
 * polls for this long: a client's event that completes meanwhile needs no
 * GPU-side wait, and a job that ends meanwhile is answered as done (no done
 * event for the client's stream to wait on). Only longer waits and jobs pay.
 */
#define EVENT_GRACE_NS 100000
#define CUDA_MAX_LAUNCHERS 16
#define RETIRED_WORDS 8192      /* pinned retired words per device: its enqueue streams at most */

struct cuda_device;

/* A launcher thread of the enqueue mode: launches its streams' jobs in order. */
struct cuda_launcher {
	struct cuda_device *dev;
	uv_thread_t thread;
	bool started;
	uv_mutex_t lock;           /* the queue below */
	uv_cond_t wake;
	struct job *head, *tail;   /* handed over by the loop */
	atomic_uint queued;
	bool sleeping;             /* waits on `wake` (lock) */
	bool stopping;
	struct job *waiting, *waiting_tail; /* the thread's own: jobs whose ready word is not set */
};

/* The backend's side of an estream. */
struct cuda_estream {
	cudaStream_t stream;
	struct cuda_launcher *launcher;
	void *workspace;           /* stream-ordered allocation */
	size_t workspace_bytes;
	uint32_t *retired;         /* pinned word: the latest seq the device finished */
	unsigned retired_slot;
	atomic_bool abandoned;     /* the client left: launch nothing more */
	bool blocked;              /* launcher's scan: an earlier job of this stream waits */
};

struct cuda_worker {
	struct cuda_device *dev;
	uv_thread_t thread;
	cudaStream_t stream;
	cudaEvent_t ev_start, ev_stop; /* autotuning's timer */
	void *workspace;           /* grows to the largest job's need */
	size_t workspace_bytes;
	uint32_t *clamped;         /* pinned host word the kernels write */
	struct nk_cublas *cublas;  /* WGRAD_ACCUM: made on first use */
	void *cublas_workspace;
	cudaEvent_t done[DONE_EVENTS]; /* interprocess events for early replies */
	uint8_t done_handle[DONE_EVENTS][64];
	unsigned done_count, done_next; /* made on first use, then round robin */
};

struct cuda_device {
	struct backend_cuda *backend;
	int ordinal;
	struct nk_device_info info;
	struct variant_cache *cache;
	bool ready;                /* lock and wake are initialised */
	uv_mutex_t lock;           /* the queue below */
	uv_cond_t wake;
	struct job *head, *tail;
	atomic_uint queued;        /* jobs in the queue, for spinning workers to watch */
	unsigned spinning;         /* workers watching `queued` instead of sleeping (lock) */
	struct nk_ipc_event_cache opened; /* clients' wait events */
	bool stopping;
	struct cuda_worker workers[CUDA_MAX_WORKERS];
	int workers_wanted;        /* config: cuda_workers */
	int worker_count;
	struct cuda_launcher launchers[CUDA_MAX_LAUNCHERS];
	int launcher_count;
	unsigned next_launcher;    /* round robin over new streams (loop thread) */
	uint32_t *retired_words;   /* pinned, RETIRED_WORDS of them */
	uint8_t retired_used[RETIRED_WORDS]; /* loop thread */
};

struct backend_cuda {
	struct backend base;
	struct backend_device *described; /* for HelloReply */
	struct cuda_device *devices;
	int device_count;
	bool autotune;
	uint64_t busy_poll_us;           /* config: spin before sleeping */
	uint64_t enqueue_spin_us;        /* config: launchers spin while jobs wait this long */
	atomic_bool fatal;
	char fatal_message[96];           /* written once, by whoever set `fatal` */
};

/*
 * One opened IPC handle, shared by a connection's regions that name it; it
 * holds one mapping of the daemon-wide cap (region_mapping_reserve).
 */
struct ipc_mapping {
	void *ptr;
	int device;
	unsigned refs;
};

/* ---- fatal errors ------------------------------------------------------------------ */

static void cuda_set_fatal(struct backend_cuda *cuda, int device, cudaError_t err)
{
	bool expected = false;
	if (!atomic_compare_exchange_strong(&cuda->fatal, &expected, true))
		return;
	snprintf(cuda->fatal_message, sizeof(cuda->fatal_message), "device %d: %s (%s)", device,
		 cudaGetErrorName(err), cudaGetErrorString(err));
	log_error("event=device_lost device=%d error=\"%s\"", device, cudaGetErrorString(err));
}

static const char *cuda_fatal_error(struct backend *backend)
{
	struct backend_cuda *cuda = (struct backend_cuda *)backend;
	return atomic_load(&cuda->fatal) ? cuda->fatal_message : NULL;
}

/* ---- regions ------------------------------------------------------------------------ */

static struct cuda_device *cuda_find_device(struct backend_cuda *cuda, int ordinal)
{
	for (int i = 0; i < cuda->device_count; i++) {
		if (cuda->devices[i].ordinal == ordinal)
			return &cuda->devices[i];
	}
	return NULL;
}

static void cuda_region_release(struct region *region)
{
	struct ipc_mapping *m = region->mapping;
	if (!m || --m->refs > 0)
		return;
	cudaSetDevice(m->device);
	cudaError_t err = cudaIpcCloseMemHandle(m->ptr);
	if (err != cudaSuccess)
		log_warn("event=ipc_close_failed device=%d error=\"%s\"", m->device,
			 cudaGetErrorString(err));
	nc__free(m);
	region_mapping_release(); /* reserved when the registration opened it (dispatch.c) */
}

/*
 * The largest memfd region whose done words the daemon pins (and maps into
 * every device) for a client's GPU to wait on: the library's block of 64
 * slots. A connection pins at most one a slot (64 slots, estream.c): 512 KiB.
 */
#define HOST_DONE_REGION_MAX (64 * ESTREAM_SLOT_BYTES)

static void cuda_host_words_release(struct region *region)
{
	cudaError_t err = cudaHostUnregister(region->base);
	if (err != cudaSuccess)
		log_warn("event=host_unregister_failed error=\"%s\"", cudaGetErrorString(err));
	region_unmap_memfd(region);
}

/*
 * Registers a memfd region holding done words with CUDA (once per region), so
 * that the daemon's streams write them at the address the daemon maps them.
 */
static int cuda_host_words_register(struct region *region, char *why, size_t why_len)
{
	if (region->release == cuda_host_words_release)
		return 0;
	if (region->kind != NORMD__REGION_KIND__HOST_MEMFD || region->release ||
	    region->mapped_size > HOST_DONE_REGION_MAX) {
		snprintf(why, why_len, "enqueue: a done word in host memory must be in a HOST_MEMFD "
			 "region of at most %d bytes", HOST_DONE_REGION_MAX);
		return NC_EINVALID_ARGUMENT;
	}
	void *gpu_view = NULL;
	cudaError_t err = cudaHostRegister(region->base, region->mapped_size,
					   cudaHostRegisterMapped | cudaHostRegisterPortable);
	if (err == cudaSuccess && (cudaHostGetDevicePointer(&gpu_view, region->base, 0) !=
					   cudaSuccess || gpu_view != region->base)) {
		cudaHostUnregister(region->base);
		err = cudaErrorNotSupported; /* the streams write the words at the host address */
	}
	if (err != cudaSuccess) {
		cudaGetLastError();
		snprintf(why, why_len, "enqueue: cannot register the done words' memory with CUDA: %s",
			 cudaGetErrorString(err));
		return err == cudaErrorNotSupported ? NC_EUNSUPPORTED : NC_ERESOURCE_EXHAUSTED;
	}
	region->release = cuda_host_words_release;
	return 0;
}

/* How long a registration waits for the deferred release of a stale mapping at its address. */
#define IPC_REMAP_WAIT_MS 2000

/* Opens a handle on `device`, checking the allocation holds `size` bytes. */
static int cuda_open_handle(int device, const uint8_t handle[64], uint64_t size,
			    struct ipc_mapping **out, char *why, size_t why_len)
{
	cudaIpcMemHandle_t h;
	memcpy(&h, handle, sizeof(h));
	void *ptr = NULL;
	cudaSetDevice(device);
	cudaError_t err = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
	/*
	 * A new allocation at the address of one this daemon still maps (freed
	 * by the client, its region unregistered, the close deferred until its
	 * last jobs retire) is refused as already mapped: the loop releases
	 * such mappings within milliseconds, and this runs off the loop.
	 */
	for (int waited_ms = 0; err == cudaErrorAlreadyMapped && waited_ms < IPC_REMAP_WAIT_MS;
	     waited_ms++) {
		cudaGetLastError();
		struct timespec pause = {0, 1000000};
		nanosleep(&pause, NULL);
		err = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
	}
	if (err != cudaSuccess) {
		cudaGetLastError(); /* not sticky: clear it */
		snprintf(why, why_len, "cannot open the CUDA IPC handle on device %d: %s%s", device,
			 cudaGetErrorString(err),
			 err == cudaErrorAlreadyMapped
				 ? " (memory at this address is still registered, or its jobs still "
				   "run: free that region, and let its jobs finish, first)"
				 : "");
		return NC_EINVALID_ARGUMENT;
	}
	uint64_t real = 0;
	const char *reason = NULL;
	if (nk_cuda_allocation_size(ptr, &real, &reason) != 0 || real < size) {
		cudaIpcCloseMemHandle(ptr);
		if (reason)
			snprintf(why, why_len, "cannot size the allocation: %s", reason);
		else
			snprintf(why, why_len, "size %llu is larger than the allocation (%llu bytes)",
				 (unsigned long long)size, (unsigned long long)real);
		return NC_EOUT_OF_RANGE;
	}
	struct ipc_mapping *m = nc__calloc(1, sizeof(*m));
	if (!m) {
		cudaIpcCloseMemHandle(ptr);
		snprintf(why, why_len, "out of memory");
		return NC_ENOMEM;
	}
	m->ptr = ptr;
	m->device = device;
	m->refs = 0;
	*out = m;
	return 0;
}

/* A CUDA_VMM_FD region's imported chunks, mapped back to back at `base`. */
struct vmm_mapping {
	int device;
	uint64_t base;
	unsigned count;                /* chunks, each one mapping of the cap */
	uint64_t *sizes;               /* count of them, in storage[] */
	uint64_t *handles;             /* imported, released at the end; in storage[] */
	uint64_t storage[];
};

static void cuda_vmm_release(struct region *region)
{
	struct vmm_mapping *m = region->mapping;
	cudaSetDevice(m->device);
	if (nk_cuda_vmm_unmap(m->base, m->sizes, m->handles, m->count) != 0)
		log_warn("event=vmm_unmap_failed device=%d chunks=%u", m->device, m->count);
	region_mapping_release_n(m->count); /* reserved by the registration (dispatch.c) */
	nc__free(m);
}

/* The status a failed import answers with. */
static int vmm_status(int rc)
{
	switch (rc) {
	case NK_VMM_TOO_LARGE:
		return NC_EOUT_OF_RANGE;
	case NK_VMM_NO_MEMORY:
		return NC_ERESOURCE_EXHAUSTED;
	case NK_VMM_NO_DRIVER:
		return NC_EUNSUPPORTED;
	default:
		return NC_EINVALID_ARGUMENT;
	}
}

/* Imports and maps a VMM region's chunks from their fds, which it closes. */
static int cuda_vmm_open(struct backend_cuda *cuda, const Normd__RegisterRegion *msg,
			 const int *fds, unsigned fd_count, struct region **out, char *why,
			 size_t why_len)
{
	int device = msg->has_device ? msg->device : 0;
	struct vmm_mapping *m = NULL;
	int rc = 0;
	if (!cuda_find_device(cuda, device)) {
		snprintf(why, why_len, "device %d is not served by this daemon", device);
		rc = NC_ENOT_FOUND;
		goto out_close;
	}
	/* fd_count == n_chunk_sizes <= NC_VMM_MAX_CHUNKS (region_check_chunks). */
	m = nc__calloc(1, sizeof(*m) + 2 * fd_count * sizeof(uint64_t));
	if (!m) {
		snprintf(why, why_len, "out of memory");
		rc = NC_ENOMEM;
		goto out_close;
	}
	m->device = device;
	m->count = fd_count;
	m->sizes = m->storage;
	m->handles = m->storage + fd_count;
	memcpy(m->sizes, msg->chunk_sizes, fd_count * sizeof(uint64_t));
	cudaSetDevice(device);
	int vrc = nk_cuda_vmm_import(device, fds, m->sizes, m->count, &m->base, m->handles, why,
				     why_len);
	if (vrc) {
		rc = vmm_status(vrc);
		nc__free(m);
		goto out_close;
	}
	struct region *region = region_new(msg->region_id, NORMD__REGION_KIND__CUDA_VMM_FD,
					   msg->size, device);
	if (!region) {
		nk_cuda_vmm_unmap(m->base, m->sizes, m->handles, m->count);
		nc__free(m);
		snprintf(why, why_len, "out of memory");
		rc = NC_ENOMEM;
		goto out_close;
	}
	region->base = (void *)(uintptr_t)m->base;
	region->mapping = m;
	region->release = cuda_vmm_release;
	*out = region;
out_close:
	/* An imported chunk lives on in its handle; the fds are not needed past the import. */
	for (unsigned i = 0; i < fd_count; i++)
		close(fds[i]);
	return rc;
}

static int cuda_region_map(struct backend *backend, struct region *twin,
			   const Normd__RegisterRegion *msg, const int *fds, unsigned fd_count,
			   struct region **out, char *why, size_t why_len)
{
	struct backend_cuda *cuda = (struct backend_cuda *)backend;
	if (msg->kind == NORMD__REGION_KIND__CUDA_VMM_FD)
		return cuda_vmm_open(cuda, msg, fds, fd_count, out, why, why_len);
	if (msg->kind == NORMD__REGION_KIND__HOST_MEMFD && fd_count > 0)
		return region_map_memfd(fds[0], msg->region_id, msg->size, out, why, why_len);
	for (unsigned i = 0; i < fd_count; i++)
		close(fds[i]);
	if (msg->kind != NORMD__REGION_KIND__CUDA_IPC) {
		snprintf(why, why_len, "region kind %d is not supported by the cuda backend "
			 "(CUDA_IPC or CUDA_VMM_FD for tensors, HOST_MEMFD with its fd for enqueue "
			 "ready words)",
			 (int)msg->kind);
		return NC_EUNSUPPORTED;
	}
	if (!msg->has_handle || msg->handle.len != 64) {
		snprintf(why, why_len, "handle is %zu bytes; a CUDA IPC handle has 64",
			 msg->has_handle ? msg->handle.len : (size_t)0);
		return NC_EINVALID_ARGUMENT;
	}
	int device = msg->has_device ? msg->device : 0;
	if (!cuda_find_device(cuda, device)) {
		snprintf(why, why_len, "device %d is not served by this daemon", device);
		return NC_ENOT_FOUND;
	}
	struct ipc_mapping *m = twin ? twin->mapping : NULL;
	int rc = m ? 0 : cuda_open_handle(device, msg->handle.data, msg->size, &m, why, why_len);
	if (rc)
		return rc;
	if (twin && msg->size > twin->size) {
		/* Sharing a mapping: its size was checked for the first region only. */
		uint64_t real = 0;
		const char *reason = NULL;
		if (nk_cuda_allocation_size(m->ptr, &real, &reason) != 0 || real < msg->size) {
			snprintf(why, why_len, "size %llu is larger than the allocation",
				 (unsigned long long)msg->size);
			return NC_EOUT_OF_RANGE;
		}
	}
	struct region *region = region_new(msg->region_id, NORMD__REGION_KIND__CUDA_IPC,
					   msg->size, device);
	if (!region) {
		if (m->refs == 0) {
			cudaIpcCloseMemHandle(m->ptr);
			nc__free(m);
		}
		snprintf(why, why_len, "out of memory");
		return NC_ENOMEM;
	}
	m->refs++;
	region->base = m->ptr;
	region->mapping = m;
	region->release = cuda_region_release;
	memcpy(region->handle, msg->handle.data, 64);
	*out = region;
	return 0;
}

/* ---- running jobs --------------------------------------------------------------------- */

/*
 * Grows a stream's workspace with stream-ordered calls: cudaFree would wait
 * for the whole device, streams blocked on clients' ready words included.
 */
static int workspace_reserve(cudaStream_t stream, void **workspace, size_t *have, size_t bytes)
{
	if (bytes <= *have)
		return 0;
	if (*workspace)
		cudaFreeAsync(*workspace, stream);
	*workspace = NULL;
	*have = 0;
	size_t rounded = (bytes + (1u << 20) - 1) & ~(size_t)((1u << 20) - 1);
	if (cudaMallocAsync(workspace, rounded, stream) != cudaSuccess) {
		cudaGetLastError();
		*workspace = NULL;
		return -1;
	}
	*have = rounded;
	return 0;
}

static int worker_reserve(struct cuda_worker *w, size_t bytes)
{
	return workspace_reserve(w->stream, &w->workspace, &w->workspace_bytes, bytes);
}

/* Times one variant on `args` (scratch buffers); returns milliseconds or -1. */
static float worker_time_variant(struct cuda_worker *w, const struct nk_norm_args *args,
				 const struct nk_variant *v)
{
	struct nk_cuda_exec exec = {w->stream, w->workspace, w->workspace_bytes, w->clamped};
	float best = -1.0f;
	for (int rep = 0; rep <= AUTOTUNE_REPS; rep++) {
		float ms = 0;
		cudaEventRecord(w->ev_start, w->stream);
		int rc = nk_cuda_norm(args, &w->dev->info, v, &exec, NULL);
		cudaEventRecord(w->ev_stop, w->stream);
		if (rc != NK_OK || cudaEventSynchronize(w->ev_stop) != cudaSuccess ||
		    cudaEventElapsedTime(&ms, w->ev_start, w->ev_stop) != cudaSuccess)
			return -1.0f;
		if (rep > 0 && (best < 0 || ms < best)) /* rep 0 warms up */
			best = ms;
	}
	return best;
}

/*
 * The scratch bytes the tensors the job uses take, laid out one after the
 * other; with `base`, also points them there (without, a sizing pass that
 * leaves the job as it is).
 */
static size_t autotune_layout(struct nk_norm_args *a, char *base)
{
	size_t wide = (size_t)a->rows * (size_t)a->cols * nk_dtype_size(a->dtype);
	size_t stat = (size_t)a->rows * sizeof(float);
	size_t vec = (size_t)a->cols * nk_dtype_size(a->weight_dtype);
	size_t used = 0;
#define AUTOTUNE_PLACE(field, bytes)                                                       \
	do {                                                                               \
		if (a->field) {                                                            \
			if (base)                                                          \
				*(void **)&a->field = base + used;                         \
			used += ((bytes) + 255) & ~(size_t)255;                             \
		}                                                                          \
	} while (0)
	AUTOTUNE_PLACE(x, wide);
	AUTOTUNE_PLACE(y, wide);
	AUTOTUNE_PLACE(dy, wide);
	AUTOTUNE_PLACE(dx, wide);
	AUTOTUNE_PLACE(mean, stat);
	AUTOTUNE_PLACE(rstd, stat);
	AUTOTUNE_PLACE(gamma, vec);
	AUTOTUNE_PLACE(beta, vec);
	AUTOTUNE_PLACE(dgamma, vec);
	AUTOTUNE_PLACE(dbeta, vec);
#undef AUTOTUNE_PLACE
	return used;
}

/*
 * Times the candidate variants on daemon-owned scratch shaped like the job
 * (about 16M elements, filled with a non-zero pattern) and keeps the fastest
 * in *best. Returns 0, or -1 when there was nothing to choose or no memory.
 */
static int autotune_job(struct cuda_worker *w, const struct nk_norm_args *job,
			struct nk_variant *best)
{
	struct nk_variant cands[AUTOTUNE_CANDIDATES];
	int n = nk_cuda_variant_candidates(job, &w->dev->info, cands, AUTOTUNE_CANDIDATES);
	if (n <= 1)
		return -1;
	struct nk_norm_args a = *job;
	int64_t rows = ((int64_t)1 << 24) / a.cols;
	a.rows = rows < 1 ? 1 : rows;
	size_t bytes = autotune_layout(&a, NULL);
	char *scratch = NULL;
	if (cudaMallocAsync((void **)&scratch, bytes, w->stream) != cudaSuccess) {
		cudaGetLastError();
		return -1;
	}
	cudaMemsetAsync(scratch, 0x3c, bytes, w->stream);
	autotune_layout(&a, scratch);
	float best_ms = -1.0f;
	for (int i = 0; i < n; i++) {
		if (!nk_cuda_variant_fits(&a, &w->dev->info, &cands[i]) ||
		    worker_reserve(w, nk_cuda_workspace_bytes(&a, &w->dev->info, &cands[i])) != 0)
			continue;
		float ms = worker_time_variant(w, &a, &cands[i]);
		if (ms >= 0 && (best_ms < 0 || ms < best_ms)) {
			best_ms = ms;
			*best = cands[i];
		}
	}
	cudaFreeAsync(scratch, w->stream);
	cudaStreamSynchronize(w->stream);
	if (best_ms < 0) {
		log_warn("event=autotune_failed device=%d op=%s cols=%lld candidates=%d: none "
			 "could be timed, keeping the rule's variant",
			 w->dev->ordinal, nk_op_name(job->op), (long long)job->cols, n);
		return -1;
	}
	char name[48];
	nk_variant_name(best, name, sizeof(name));
	log_info("event=autotune device=%d op=%s cols=%lld candidates=%d best=%s ms=%.4f",
		 w->dev->ordinal, nk_op_name(job->op), (long long)job->cols, n, name,
		 (double)best_ms);
	return 0;
}

/*
 * The variant for a job: from the cache, else by rule or, with a worker to
 * time them on (`w`, NULL for launchers, which never wait for the GPU), by timing.
 */
static void device_pick_variant(struct cuda_device *dev, struct cuda_worker *w,
				const struct nk_norm_args *args, struct nk_variant *v)
{
	/* The cache's key does not tell jobs with norm variants apart: they take the rules' default. */
	if (nk_norm_features(args)) {
		nk_cuda_variant_default(args, &dev->info, v);
		return;
	}
	if (variant_cache_lookup(dev->cache, args, v))
		return;
	nk_cuda_variant_default(args, &dev->info, v);
	enum variant_source source = VS_RULE;
	if (w && dev->backend->autotune && autotune_job(w, args, v) == 0)
		source = VS_AUTOTUNE;
	variant_cache_store(dev->cache, args, v, source);
}

static void worker_fail(struct job *job, int status, const char *fmt, const char *detail)
{
	job->status = status;
	snprintf(job->message, sizeof(job->message), fmt, detail);
}

/* ---- the IPC-event completion mode --------------------------------------------------- */

/* Makes the worker's stream wait for the client's event; 0 or a status. */
static int worker_wait_client(struct cuda_worker *w, struct job *job)
{
	if (!job->has_wait_event)
		return 0;
	/* Clients' wait events stay open (up to OPENED_EVENTS a device). */
	cudaEvent_t event = nk_ipc_event_open(&w->dev->opened, job->wait_event);
	if (!event) {
		worker_fail(job, NC_EINVALID_ARGUMENT, "%s",
			    "wait_event: cannot open the CUDA IPC event handle");
		return job->status;
	}
	/*
	 * Usually the client's work is done by the time the request is read: a
	 * GPU-side wait on another process's event would then only cost a
	 * switch between the two contexts (hundreds of microseconds).
	 */
	cudaError_t state;
	int rc = 0;
	uint64_t until = stats_now_ns() + EVENT_GRACE_NS;
	while ((state = cudaEventQuery(event)) == cudaErrorNotReady && stats_now_ns() < until)
		sched_yield();
	if (state == cudaErrorNotReady && cudaStreamWaitEvent(w->stream, event, 0) != cudaSuccess) {
		cudaGetLastError();
		worker_fail(job, NC_EDEVICE_ERROR, "%s", "cudaStreamWaitEvent on wait_event failed");
		rc = job->status;
	} else if (state != cudaSuccess && state != cudaErrorNotReady) {
		cudaGetLastError();
		worker_fail(job, NC_EINVALID_ARGUMENT, "%s", "wait_event: cannot query the event");
		rc = job->status;
	}
	nk_ipc_event_release(&w->dev->opened, event); /* a queued wait needs it no longer */
	return rc;
}

/*
 * Records a done event after the job on the worker's stream and posts the
 * job's reply now, naming that event, so the client's stream can wait for
 * the job without its CPU waiting. The worker then waits for the job as
 * usual before the job's memory is released. A done event is re-recorded
 * DONE_EVENTS jobs later on the same stream: a client that waits on it only
 * then waits for later work of that stream too, never for less.
 */
static void worker_early_reply(struct cuda_worker *w, struct job *job)
{
	if (!job->early_reply)
		return;
	uint64_t until = stats_now_ns() + EVENT_GRACE_NS;
	cudaError_t state;
	while ((state = cudaStreamQuery(w->stream)) == cudaErrorNotReady && stats_now_ns() < until)
		sched_yield();
	if (state != cudaErrorNotReady)
		return; /* done (or failed): answered as usual after worker_sync */
	if (w->done_count < DONE_EVENTS) {
		cudaIpcEventHandle_t h;
		if (cudaEventCreateWithFlags(&w->done[w->done_count],
					     cudaEventInterprocess | cudaEventDisableTiming) !=
			    cudaSuccess ||
		    cudaIpcGetEventHandle(&h, w->done[w->done_count]) != cudaSuccess) {
			cudaGetLastError();
			return; /* no early reply: the job is answered when done */
		}
		memcpy(w->done_handle[w->done_count++], &h, 64);
	}
	unsigned slot = w->done_next++ % w->done_count;
	struct job *notice = nc__calloc(1, sizeof(*notice));
	if (!notice || cudaEventRecord(w->done[slot], w->stream) != cudaSuccess) {
		nc__free(notice);
		return;
	}
	notice->notice = true;
	notice->client = job->client;
	notice->request_id = job->request_id;
	notice->status = NC_OK;
	memcpy(notice->done_event, w->done_handle[slot], 64);
	snprintf(notice->variant, sizeof(notice->variant), "%s", job->variant);
	job->replied = true;
	job_post_completion(notice);
}

/*
 * Waits for the worker's stream (spinning: see device_init) and notes the
 * job's device time, from its launch to the end of the wait as this thread
 * saw it. Timing events would be exact but cost two event records per job,
 * several microseconds of a tiny job's end-to-end latency (BENCHMARKS.md).
 * A failure here is sticky (fatal); returns its status or 0.
 */
static int worker_sync(struct cuda_worker *w, struct job *job, uint64_t launched_ns)
{
	cudaError_t err = cudaStreamSynchronize(w->stream);
	job->t_end_ns = job->t_start_ns + (stats_now_ns() - launched_ns);
	if (err == cudaSuccess)
		return 0;
	cuda_set_fatal(w->dev->backend, w->dev->ordinal, err);
	worker_fail(job, NC_EDEVICE_ERROR, "the device failed running the job: %s",
		    cudaGetErrorString(err));
	return job->status;
}

/* Runs a WGRAD_ACCUM job through cuBLAS on the worker's stream. */
static void worker_run_wgrad(struct cuda_worker *w, struct job *job)
{
	const char *why = NULL;
	if (!w->cublas) {
		if (!w->cublas_workspace &&
		    cudaMalloc(&w->cublas_workspace, CUBLAS_WORKSPACE_BYTES) != cudaSuccess) {
			cudaGetLastError();
			w->cublas_workspace = NULL;
			return worker_fail(job, NC_ERESOURCE_EXHAUSTED, "%s",
					   "out of device memory for the cuBLAS workspace");
		}
		int rc = nk_cublas_create(w->stream, w->cublas_workspace, CUBLAS_WORKSPACE_BYTES,
					  &w->cublas, &why);
		if (rc != NK_OK)
			return worker_fail(job, rc == NK_EUNSUPPORTED ? NC_EUNSUPPORTED
								      : NC_EDEVICE_ERROR,
					   "%s", why);
	}
	if (worker_wait_client(w, job))
		return;
	uint64_t launched_ns = stats_now_ns();
	int rc = nk_cublas_wgrad(w->cublas, &job->gemm, &why);
	snprintf(job->variant, sizeof(job->variant), "cublas/gemm_ex/%s",
		 nk_dtype_name(job->gemm.dtype));
	if (rc == NK_OK)
		worker_early_reply(w, job);
	if (worker_sync(w, job, launched_ns))
		return;
	if (rc != NK_OK)
		return worker_fail(job, rc == NK_EUNSUPPORTED ? NC_EUNSUPPORTED : NC_EDEVICE_ERROR,
				   "%s", why);
	job->status = NC_OK;
}

static void worker_run(struct cuda_worker *w, struct job *job)
{
	struct backend_cuda *cuda = w->dev->backend;
	job->t_start_ns = stats_now_ns();
	job->t_end_ns = job->t_start_ns;
	if (atomic_load(&cuda->fatal))
		return worker_fail(job, NC_EDEVICE_ERROR, "the device failed earlier: %s",
				   cuda->fatal_message);
	if (job->deadline_us && (job->t_start_ns - job->t_arrive_ns) / 1000 > job->deadline_us)
		return worker_fail(job, NC_EOUT_OF_RANGE, "%s",
				   "deadline passed before the job could start");
	if (job->wgrad)
		return worker_run_wgrad(w, job);
	struct nk_variant v, ran;
	device_pick_variant(w->dev, w, &job->args, &v);
	if (worker_reserve(w, nk_cuda_workspace_bytes(&job->args, &w->dev->info, &v)) != 0)
		return worker_fail(job, NC_ERESOURCE_EXHAUSTED, "%s",
				   "out of device memory for the job's workspace");
	*w->clamped = 0;
	if (worker_wait_client(w, job))
		return;
	struct nk_cuda_exec exec = {w->stream, w->workspace, w->workspace_bytes, w->clamped};
	uint64_t launched_ns = stats_now_ns();
	int rc = nk_cuda_norm(&job->args, &w->dev->info, &v, &exec, &ran);
	if (rc == NK_OK) {
		nk_variant_name(&ran, job->variant, sizeof(job->variant));
		worker_early_reply(w, job);
	}
	if (worker_sync(w, job, launched_ns))
		return;
	if (rc != NK_OK)
		return worker_fail(job, rc == NK_EINVAL ? NC_EINVALID_ARGUMENT : NC_EDEVICE_ERROR,
				   "the kernels refused the job: %s", nk_cuda_last_error());
	job->clamped_cols = *w->clamped;
	job->status = NC_OK;
}

/*
 * The next job of the device's queue, or NULL when the device stops. A
 * worker that finished a job less than busy_poll_us ago watches the queue
 * (a sleeping thread takes tens of microseconds to wake, which a tiny job
 * would feel end to end); past that it sleeps on the condition variable.
 * A spinner that loses a job to another spins on rather than sleeping.
 */
static struct job *worker_next(struct cuda_device *dev, uint64_t spin_until)
{
	uv_mutex_lock(&dev->lock);
	for (;;) {
		struct job *job = dev->head;
		if (job) {
			dev->head = job->next;
			if (!dev->head)
				dev->tail = NULL;
			atomic_fetch_sub(&dev->queued, 1);
			uv_mutex_unlock(&dev->lock);
			return job;
		}
		if (dev->stopping)
			break;
		if (stats_now_ns() < spin_until) {
			dev->spinning++;
			uv_mutex_unlock(&dev->lock);
			while (atomic_load_explicit(&dev->queued, memory_order_acquire) == 0 &&
			       stats_now_ns() < spin_until)
				sched_yield(); /* a loaded host's other threads come first */
			uv_mutex_lock(&dev->lock);
			dev->spinning--;
		} else {
			uv_cond_wait(&dev->wake, &dev->lock);
		}
	}
	uv_mutex_unlock(&dev->lock);
	return NULL;
}

static void worker_main(void *arg)
{
	struct cuda_worker *w = arg;
	struct cuda_device *dev = w->dev;
	uint64_t spin_ns = dev->backend->busy_poll_us * 1000;
	uint64_t spin_until = 0;
	cudaSetDevice(dev->ordinal);
	struct job *job;
	while ((job = worker_next(dev, spin_until)) != NULL) {
		worker_run(w, job);
		job_post_completion(job);
		spin_until = stats_now_ns() + spin_ns;
	}
}

/* ---- the enqueue mode ------------------------------------------------------------------ */

static void launcher_fail(struct job *job, int status, const char *message)
{
	if (job->status == NC_OK)
		worker_fail(job, status, "%s", message);
}

/*
 * Launches one job of an estream whose ready word is set: the kernel, then
 * the writes of done and retired. A refused or failed job is released the
 * same way, after its outputs are poisoned (0xff bytes: NaN in every dtype).
 * Never waits for the GPU.
 */
static void launcher_run(struct cuda_launcher *l, struct job *job)
{
	struct cuda_device *dev = l->dev;
	struct estream *es = job->estream;
	struct cuda_estream *ce = es->backend_state;
	job->t_start_ns = job->t_end_ns = stats_now_ns();
	if (job->status == NC_OK && atomic_load(&ce->abandoned))
		launcher_fail(job, NC_ESHUTTING_DOWN, "the client disconnected");
	if (job->status == NC_OK && atomic_load(&dev->backend->fatal))
		launcher_fail(job, NC_EDEVICE_ERROR, dev->backend->fatal_message);
	if (job->status == NC_OK && job->deadline_us &&
	    (job->t_start_ns - job->t_arrive_ns) / 1000 > job->deadline_us)
		launcher_fail(job, NC_EOUT_OF_RANGE, "deadline passed before the job could start");
	if (job->status == NC_OK && job->wgrad)
		launcher_fail(job, NC_EUNSUPPORTED,
			      "WGRAD_ACCUM runs in the synchronous and event modes, not enqueued");
	if (job->status == NC_OK) {
		struct nk_variant v, ran;
		device_pick_variant(dev, NULL, &job->args, &v);
		if (workspace_reserve(ce->stream, &ce->workspace, &ce->workspace_bytes,
				      nk_cuda_workspace_bytes(&job->args, &dev->info, &v)) != 0) {
			launcher_fail(job, NC_ERESOURCE_EXHAUSTED,
				      "out of device memory for the job's workspace");
		} else {
			struct nk_cuda_exec exec = {ce->stream, ce->workspace, ce->workspace_bytes, NULL};
			if (nk_cuda_norm(&job->args, &dev->info, &v, &exec, &ran) == NK_OK)
				nk_variant_name(&ran, job->variant, sizeof(job->variant));
			else
				worker_fail(job, NC_EDEVICE_ERROR, "the kernels refused the job: %s",
					    nk_cuda_last_error());
		}
	}
	if (job->status != NC_OK && job->bound && job->device == es->device &&
	    !atomic_load(&ce->abandoned)) {
		struct job_output out[JOB_MAX_OUTPUTS];
		unsigned n = job_outputs(job, out);
		for (unsigned i = 0; i < n; i++) {
			if (cudaMemsetAsync(out[i].ptr, 0xff, (size_t)out[i].bytes, ce->stream) !=
			    cudaSuccess)
				cudaGetLastError(); /* not sticky; the reply carries the job's error */
		}
	}
	if (nk_cuda_stream_write(ce->stream, es->done, ce->retired, job->seq) != 0) {
		cudaError_t err = cudaGetLastError();
		cuda_set_fatal(dev->backend, dev->ordinal, err != cudaSuccess ? err : cudaErrorUnknown);
	}
}

/* Whether a waiting job may go: its ready word is set, or it needs none. */
static bool launcher_job_ready(const struct job *job)
{
	const struct estream *es = job->estream;
	const struct cuda_estream *ce = es->backend_state;
	if (atomic_load(&ce->abandoned))
		return true; /* failed at once: no kernel of a departed client runs */
	if (job->status != NC_OK && !job->bound)
		return true; /* nothing to poison: release at once */
	uint32_t ready = atomic_load_explicit((_Atomic uint32_t *)es->ready, memory_order_acquire);
	return seq_reached(ready, job->seq);
}

/*
 * One pass over the waiting jobs, oldest first: launches each whose ready
 * word is set and that no earlier job of its stream precedes. Returns how many.
 */
static unsigned launcher_scan(struct cuda_launcher *l)
{
	unsigned launched = 0;
	for (struct job *j = l->waiting; j; j = j->next)
		((struct cuda_estream *)j->estream->backend_state)->blocked = false;
	struct job **link = &l->waiting, *prev = NULL;
	while (*link) {
		struct job *job = *link;
		struct cuda_estream *ce = job->estream->backend_state;
		if (ce->blocked || !launcher_job_ready(job)) {
			ce->blocked = true;
			prev = job;
			link = &job->next;
			continue;
		}
		*link = job->next;
		if (l->waiting_tail == job)
			l->waiting_tail = prev;
		launcher_run(l, job);
		job_post_completion(job);
		launched++;
	}
	return launched;
}

/* Moves what the loop handed over to the waiting list; false when stopping with nothing left. */
static bool launcher_take(struct cuda_launcher *l, bool may_sleep)
{
	/*
	 * Nothing handed over and no sleep due: skip the lock, which the loop's
	 * launcher_push would otherwise find held on every pass of the scan. A
	 * stop is still seen: a launcher with nothing waiting soon may sleep.
	 */
	if (!may_sleep && atomic_load(&l->queued) == 0)
		return true;
	uv_mutex_lock(&l->lock);
	while (may_sleep && !l->head && !l->stopping) {
		l->sleeping = true;
		uv_cond_wait(&l->wake, &l->lock);
		l->sleeping = false;
	}
	struct job *head = l->head;
	l->head = l->tail = NULL;
	atomic_store(&l->queued, 0);
	bool stop = l->stopping && !head && !l->waiting;
	uv_mutex_unlock(&l->lock);
	while (head) {
		struct job *next = head->next;
		head->next = NULL;
		if (l->waiting_tail)
			l->waiting_tail->next = head;
		else
			l->waiting = head;
		l->waiting_tail = head;
		head = next;
	}
	return !stop;
}

/*
 * The launcher: polls the ready words of its waiting jobs without sleeping
 * (yielding between passes) for enqueue_spin_us after its last launch or new
 * job, then every 20 us; with nothing waiting it spins busy_poll_us and then
 * sleeps on its condition variable. A training step's host runs ahead of its
 * GPU, so its jobs wait: a sleeping launcher would add its sleep to each.
 */
static void launcher_main(void *arg)
{
	struct cuda_launcher *l = arg;
	uint64_t idle_spin_ns = l->dev->backend->busy_poll_us * 1000;
	uint64_t wait_spin_ns = l->dev->backend->enqueue_spin_us * 1000;
	uint64_t last_progress = stats_now_ns();
	/* nanosleep(20 us) takes 90-100 us under the default 50 us timer slack. */
	prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
	cudaSetDevice(l->dev->ordinal);
	for (;;) {
		bool idle = !l->waiting && stats_now_ns() - last_progress > idle_spin_ns;
		struct job *newest = l->waiting_tail;
		if (!launcher_take(l, idle && atomic_load(&l->queued) == 0))
			break;
		if (l->waiting_tail != newest)
			last_progress = stats_now_ns(); /* new work: watch it closely for a while */
		if (l->stopping) {
			/* Leaving: what still waits is failed (the loop abandons every stream first). */
			for (struct job *j = l->waiting; j; j = j->next)
				atomic_store(&((struct cuda_estream *)j->estream->backend_state)->abandoned,
					     true);
		}
		if (launcher_scan(l) > 0) {
			last_progress = stats_now_ns();
		} else if (atomic_load(&l->queued) == 0) {
			uint64_t quiet = stats_now_ns() - last_progress;
			if (quiet < (l->waiting ? wait_spin_ns : idle_spin_ns)) {
				sched_yield();
			} else if (l->waiting) {
				/* Clients whose GPUs are far behind: look every 20 us, not constantly. */
				struct timespec pause = {0, 20000};
				nanosleep(&pause, NULL);
			}
		}
	}
}

static void launcher_push(struct cuda_launcher *l, struct job *job)
{
	job->next = NULL;
	uv_mutex_lock(&l->lock);
	if (l->tail)
		l->tail->next = job;
	else
		l->head = job;
	l->tail = job;
	atomic_fetch_add(&l->queued, 1);
	if (l->sleeping)
		uv_cond_signal(&l->wake);
	uv_mutex_unlock(&l->lock);
}

static int cuda_stream_open(struct backend *backend, struct estream *es, char *why,
			    size_t why_len)
{
	struct cuda_device *dev = cuda_find_device((struct backend_cuda *)backend, es->device);
	if (!dev) {
		snprintf(why, why_len, "enqueue: the slot's device %d is not one this daemon serves",
			 es->device);
		return NC_EINVALID_ARGUMENT;
	}
	if (es->sem->device >= 0) {
		snprintf(why, why_len, "enqueue: the ready word must be in host memory (a HOST_MEMFD "
			 "region), where the daemon watches it");
		return NC_EINVALID_ARGUMENT;
	}
	cudaSetDevice(dev->ordinal);
	if (es->done_region->device < 0) {
		int rc = cuda_host_words_register(es->done_region, why, why_len);
		if (rc)
			return rc;
	}
	unsigned slot = 0;
	while (slot < RETIRED_WORDS && dev->retired_used[slot])
		slot++;
	struct cuda_estream *ce = slot < RETIRED_WORDS ? nc__calloc(1, sizeof(*ce)) : NULL;
	if (!ce) {
		snprintf(why, why_len, "enqueue: no room for another stream on device %d",
			 dev->ordinal);
		return NC_ERESOURCE_EXHAUSTED;
	}
	if (cudaStreamCreateWithFlags(&ce->stream, cudaStreamNonBlocking) != cudaSuccess) {
		cudaGetLastError();
		nc__free(ce);
		snprintf(why, why_len, "enqueue: cannot create a stream on device %d", dev->ordinal);
		return NC_ERESOURCE_EXHAUSTED;
	}
	dev->retired_used[slot] = 1;
	ce->retired_slot = slot;
	ce->retired = &dev->retired_words[slot];
	atomic_store((_Atomic uint32_t *)ce->retired, es->last_seq);
	ce->launcher = &dev->launchers[dev->next_launcher++ % (unsigned)dev->launcher_count];
	es->backend_state = ce;
	return 0;
}

static uint32_t cuda_stream_retired(struct backend *backend, struct estream *es)
{
	(void)backend;
	struct cuda_estream *ce = es->backend_state;
	return atomic_load_explicit((_Atomic uint32_t *)ce->retired, memory_order_acquire);
}

static void cuda_stream_abandon(struct backend *backend, struct estream *es)
{
	(void)backend;
	struct cuda_estream *ce = es->backend_state;
	atomic_store(&ce->abandoned, true); /* its launcher fails what still waits */
}

static void cuda_stream_close(struct backend *backend, struct estream *es)
{
	struct cuda_device *dev = cuda_find_device((struct backend_cuda *)backend, es->device);
	struct cuda_estream *ce = es->backend_state;
	if (!ce)
		return;
	if (ce->workspace)
		cudaFreeAsync(ce->workspace, ce->stream);
	cudaStreamDestroy(ce->stream); /* returns at once; freed once its work is done */
	dev->retired_used[ce->retired_slot] = 0;
	nc__free(ce);
	es->backend_state = NULL;
}

static int cuda_submit(struct backend *backend, struct job *job)
{
	struct backend_cuda *cuda = (struct backend_cuda *)backend;
	if (job->estream) {
		/* Refused jobs too (their device may be unknown): they release the stream. */
		struct cuda_estream *ce = job->estream->backend_state;
		launcher_push(ce->launcher, job);
		return NC_OK;
	}
	struct cuda_device *dev = cuda_find_device(cuda, job->device);
	if (!dev) {
		snprintf(job->message, sizeof(job->message),
			 "the job's tensors are not in CUDA device memory");
		return NC_EINVALID_ARGUMENT;
	}
	if (atomic_load(&cuda->fatal)) {
		snprintf(job->message, sizeof(job->message), "the device failed: %s",
			 cuda->fatal_message);
		return NC_EDEVICE_ERROR;
	}
	job->next = NULL;
	uv_mutex_lock(&dev->lock);
	if (dev->tail)
		dev->tail->next = job;
	else
		dev->head = job;
	dev->tail = job;
	/* Spinners take queued jobs without a wake-up (a futex call here). */
	if (atomic_fetch_add(&dev->queued, 1) + 1 > dev->spinning)
		uv_cond_signal(&dev->wake);
	uv_mutex_unlock(&dev->lock);
	return NC_OK;
}

/* Stats: the variant cache's hit and miss counts of one device (loop thread). */
static void cuda_variant_cache_counts(struct backend *backend, int device, uint64_t *hits,
				      uint64_t *misses)
{
	struct cuda_device *dev = cuda_find_device((struct backend_cuda *)backend, device);
	*hits = *misses = 0;
	if (dev && dev->cache)
		variant_cache_counts(dev->cache, hits, misses);
}

static struct variant_row *cuda_variants(struct backend *backend, size_t *n)
{
	struct backend_cuda *cuda = (struct backend_cuda *)backend;
	struct variant_row *rows = NULL;
	*n = 0;
	for (int i = 0; i < cuda->device_count; i++)
		variant_cache_rows(cuda->devices[i].cache, &rows, n);
	return rows;
}

/* ---- set-up and tear-down --------------------------------------------------------------- */

static void device_stop(struct cuda_device *dev)
{
	if (dev->ready) {
		uv_mutex_lock(&dev->lock);
		dev->stopping = true;
		uv_cond_broadcast(&dev->wake);
		uv_mutex_unlock(&dev->lock);
	}
	for (int i = 0; i < dev->worker_count; i++)
		uv_thread_join(&dev->workers[i].thread);
	for (int i = 0; i < dev->launcher_count; i++) {
		struct cuda_launcher *l = &dev->launchers[i];
		uv_mutex_lock(&l->lock);
		l->stopping = true;
		uv_cond_signal(&l->wake);
		uv_mutex_unlock(&l->lock);
		if (l->started)
			uv_thread_join(&l->thread);
		uv_cond_destroy(&l->wake);
		uv_mutex_destroy(&l->lock);
	}
	cudaSetDevice(dev->ordinal);
	if (dev->retired_words)
		cudaFreeHost(dev->retired_words);
	for (int i = 0; i < dev->workers_wanted; i++) {
		struct cuda_worker *w = &dev->workers[i];
		if (w->stream)
			cudaStreamDestroy(w->stream);
		if (w->ev_start)
			cudaEventDestroy(w->ev_start);
		if (w->ev_stop)
			cudaEventDestroy(w->ev_stop);
		cudaFree(w->workspace);
		cudaFreeHost(w->clamped);
		nk_cublas_destroy(w->cublas);
		cudaFree(w->cublas_workspace);
		for (unsigned e = 0; e < w->done_count; e++)
			cudaEventDestroy(w->done[e]);
	}
	variant_cache_destroy(dev->cache);
	if (dev->ready) {
		nk_ipc_event_cache_destroy(&dev->opened);
		uv_cond_destroy(&dev->wake);
		uv_mutex_destroy(&dev->lock);
	}
}

static void cuda_destroy(struct backend *backend)
{
	struct backend_cuda *cuda = (struct backend_cuda *)backend;
	if (!cuda)
		return;
	for (int i = 0; i < cuda->device_count; i++)
		device_stop(&cuda->devices[i]);
	nc__free(cuda->devices);
	nc__free(cuda->described);
	nc__free(cuda);
}

static int worker_init(struct cuda_worker *w, struct cuda_device *dev)
{
	w->dev = dev;
	if (cudaStreamCreateWithFlags(&w->stream, cudaStreamNonBlocking) != cudaSuccess ||
	    cudaEventCreate(&w->ev_start) != cudaSuccess ||
	    cudaEventCreate(&w->ev_stop) != cudaSuccess ||
	    cudaMallocHost((void **)&w->clamped, sizeof(uint32_t)) != cudaSuccess)
		return -1;
	return 0;
}

/* The enqueue mode's launchers and retired words of a device. */
static int device_init_enqueue(struct cuda_device *dev, const struct config *cfg)
{
	if (cudaMallocHost((void **)&dev->retired_words, RETIRED_WORDS * sizeof(uint32_t)) !=
		    cudaSuccess) {
		cudaGetLastError();
		return -1;
	}
	int wanted = (int)cfg->enqueue_threads;
	for (; dev->launcher_count < wanted; dev->launcher_count++) {
		struct cuda_launcher *l = &dev->launchers[dev->launcher_count];
		l->dev = dev;
		if (uv_mutex_init(&l->lock))
			return -1;
		if (uv_cond_init(&l->wake)) {
			uv_mutex_destroy(&l->lock);
			return -1;
		}
		if (uv_thread_create(&l->thread, launcher_main, l) != 0) {
			dev->launcher_count++; /* destroyed by device_stop */
			return -1;
		}
		l->started = true;
	}
	return 0;
}

static int device_init(struct backend_cuda *cuda, struct cuda_device *dev,
		       struct backend_device *described, int ordinal, const struct config *cfg)
{
	struct cudaDeviceProp prop;
	dev->backend = cuda;
	dev->ordinal = ordinal;
	/*
	 * Workers wait for their stream by polling it, yielding the core
	 * between polls: a tiny job's answer then leaves within a microsecond
	 * of the kernel's end, while a loaded host still gets the core to the
	 * threads that have work (pure spinning took it from them: BENCHMARKS.md).
	 * The flag must be set before the context exists.
	 */
	if (cudaSetDevice(ordinal) != cudaSuccess ||
	    cudaSetDeviceFlags(cfg->busy_poll_us ? cudaDeviceScheduleYield
						 : cudaDeviceScheduleBlockingSync) != cudaSuccess ||
	    cudaFree(NULL) != cudaSuccess ||
	    cudaGetDeviceProperties(&prop, ordinal) != cudaSuccess) {
		log_error("event=device_init_failed device=%d error=\"%s\"", ordinal,
			  cudaGetErrorString(cudaGetLastError()));
		return -1;
	}
	dev->info = (struct nk_device_info){
		.ordinal = ordinal,
		.sm_count = prop.multiProcessorCount,
		.max_threads_per_sm = prop.maxThreadsPerMultiProcessor,
		.max_smem_per_block_optin = prop.sharedMemPerBlockOptin,
		.cc_major = prop.major,
		.cc_minor = prop.minor,
		.mem_gbps = nk_cuda_mem_gbps(ordinal),
	};
	described->index = ordinal;
	memcpy(described->uuid, prop.uuid.bytes, 16);
	snprintf(described->name, sizeof(described->name), "%.127s", prop.name);
	described->sm_count = (uint32_t)prop.multiProcessorCount;
	described->total_memory = prop.totalGlobalMem;
	dev->cache = variant_cache_create(described->uuid, ordinal, cfg->state_dir);
	if (!dev->cache || uv_mutex_init(&dev->lock))
		return -1;
	if (nk_ipc_event_cache_init(&dev->opened, OPENED_EVENTS)) {
		uv_mutex_destroy(&dev->lock);
		return -1;
	}
	if (uv_cond_init(&dev->wake)) {
		uv_mutex_destroy(&dev->lock);
		nk_ipc_event_cache_destroy(&dev->opened);
		return -1;
	}
	dev->ready = true;
	dev->workers_wanted = (int)cfg->cuda_workers;
	for (int i = 0; i < dev->workers_wanted; i++) {
		if (worker_init(&dev->workers[i], dev) != 0)
			return -1;
	}
	for (; dev->worker_count < dev->workers_wanted; dev->worker_count++) {
		struct cuda_worker *w = &dev->workers[dev->worker_count];
		if (uv_thread_create(&w->thread, worker_main, w) != 0)
			return -1;
	}
	if (device_init_enqueue(dev, cfg))
		return -1;
	int mps = nk_cuda_mps_enabled(ordinal);
	cuda->base.mps |= mps == 1;
	log_info("event=device index=%d name=\"%s\" sms=%d memory=%llu cc=%d.%d workers=%d "
		 "launchers=%d mps=%s",
		 ordinal, prop.name, prop.multiProcessorCount,
		 (unsigned long long)prop.totalGlobalMem, prop.major, prop.minor,
		 dev->worker_count, dev->launcher_count,
		 mps == 1 ? "yes" : mps == 0 ? "no" : "unknown");
	if (mps != 1)
		log_warn("event=no_mps device=%d hint=\"without NVIDIA MPS every hand-off between a "
			 "client's enqueued work and the daemon's is a GPU time-slice switch (~140 us "
			 "on an H100); run the MPS control daemon (docs/ENQUEUE.md)\"",
			 ordinal);
	return 0;
}

/* Parses "all", "0" or "0,2" into ordinals; returns the count or -1. */
static int parse_devices(const char *spec, int available, int *ordinals)
{
	if (!strcmp(spec, "all")) {
		for (int i = 0; i < available; i++)
			ordinals[i] = i;
		return available;
	}
	int n = 0;
	uint32_t ids[CONFIG_MAX_IDS];
	int count = config_parse_ids(spec, ids, CONFIG_MAX_IDS);
	for (int i = 0; i < count; i++) {
		if ((int)ids[i] >= available)
			return -1;
		bool seen = false;
		for (int j = 0; j < n; j++)
			seen |= ordinals[j] == (int)ids[i];
		if (!seen)
			ordinals[n++] = (int)ids[i];
	}
	return count > 0 ? n : -1;
}

int backend_cuda_create(const struct config *cfg, struct backend **out)
{
	/* Clients' streams side by side: as many hardware queues as the device has. */
	setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
	int available = 0;
	cudaError_t err = cudaGetDeviceCount(&available);
	if (err != cudaSuccess || available == 0) {
		log_error("event=no_device device=%s error=\"no usable CUDA device: %s\" "
			  "hint=\"use --device cpu for the CPU backend\"",
			  cfg->device, err != cudaSuccess ? cudaGetErrorString(err) : "none found");
		return NC_EUNSUPPORTED;
	}
	int ordinals[CUDA_MAX_DEVICES];
	int count = parse_devices(cfg->device, available < CUDA_MAX_DEVICES ? available
									     : CUDA_MAX_DEVICES,
				  ordinals);
	if (count <= 0) {
		log_error("event=bad_device device=%s error=\"expected cpu, all, or device indexes "
			  "below %d\"",
			  cfg->device, available);
		return NC_EINVALID_ARGUMENT;
	}
	struct backend_cuda *cuda = nc__calloc(1, sizeof(*cuda));
	if (!cuda)
		return NC_ENOMEM;
	cuda->base = (struct backend){
		.name = "cuda",
		.kind = NORMD__BACKEND_KIND__BACKEND_CUDA,
		.region_map = cuda_region_map,
		.submit = cuda_submit,
		.fatal_error = cuda_fatal_error,
		.variants = cuda_variants,
		.variant_cache_counts = cuda_variant_cache_counts,
		.destroy = cuda_destroy,
		.orders_streams = true,
		.stream_open = cuda_stream_open,
		.stream_retired = cuda_stream_retired,
		.stream_abandon = cuda_stream_abandon,
		.stream_close = cuda_stream_close,
	};
	cuda->autotune = cfg->autotune;
	cuda->base.norm_features = NK_FEATURES_ALL; /* the fused family (kernels/norm_cuda_fused.cu) */
	cuda->busy_poll_us = cfg->busy_poll_us;
	cuda->enqueue_spin_us = cfg->enqueue_spin_us;
	cuda->base.poll_completions = cfg->busy_poll_us > 0;
	cuda->devices = nc__calloc((size_t)count, sizeof(*cuda->devices));
	cuda->described = nc__calloc((size_t)count, sizeof(*cuda->described));
	if (!cuda->devices || !cuda->described) {
		cuda_destroy(&cuda->base);
		return NC_ENOMEM;
	}
	for (int i = 0; i < count; i++) {
		cuda->device_count = i + 1;
		if (device_init(cuda, &cuda->devices[i], &cuda->described[i], ordinals[i], cfg)) {
			cuda_destroy(&cuda->base);
			return NC_EDEVICE_ERROR;
		}
	}
	cuda->base.devices = cuda->described;
	cuda->base.device_count = count;
	*out = &cuda->base;
	return 0;
}
