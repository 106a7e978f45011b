/*
 * The enqueue mode (docs/ENQUEUE.md): a job ordered with a caller's stream
 * through a semaphore slot, with no thread waiting for a GPU.
 *
 * Per device the connection owns NC__SLOTS slots of 128 bytes in a memfd,
 * registered with the daemon as an ordinary region: the ready word at +0 and
 * the done word at +64 of each slot. On the CUDA backend the memfd is also
 * registered with CUDA, so the caller's GPU writes ready into host memory,
 * where the daemon watches it from its CPU, and waits on done there. A
 * caller stream takes a slot on first use. For each job the stream writes
 * ready = seq and waits for done >= seq (one batched call), then the
 * request goes out; the daemon launches the job once it sees ready and
 * writes done after it. The words live in the client's memory, which the
 * daemon keeps mapped while it has jobs on them, so each side can always
 * write the word it waits on and release itself.
 *
 * A watcher thread per connection sleeps in poll() for the socket's hang-up;
 * if the daemon dies it stores every slot's done word up to the last seq
 * issued, from the CPU, so no caller stream waits forever. A release queued
 * on a stream could wait forever itself: the caller's waiting streams share
 * hardware queues with every other stream of the process (a few of them per
 * client under MPS), and a stream blocked on its wait blocks its queue.
 */
#include <cuda_runtime_api.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "client/lib/internal.h"
#include "kernels/cuda_driver.h"
#include "proto/frame.h"
#include "proto/job_roles.h"

#define NC__SLOTS 64
#define NC__SLOT_BYTES 128
#define NC__DONE_OFFSET 64
#define NC__BLOCKS 16 /* devices one connection enqueues on */

struct nc__slot {
	void *key;     /* the caller's stream */
	bool used;
	uint32_t seq;  /* the latest seq issued */
};

/* One device's semaphore slots. */
struct nc__block {
	int device;              /* -1: host memory (CPU backend) */
	nc_region *ready_region; /* the memfd of the ready words */
	uint8_t *ready_host;     /* its mapping here */
	uint8_t *ready_gpu;      /* CUDA: the same memory as the caller's GPU reaches it */
	struct nc__slot slots[NC__SLOTS];
};

struct nc__enqueue {
	pthread_mutex_t lock;    /* one enqueue at a time: seq order = GPU order = send order */
	/*
	 * Guards the slots' seqs, block_count and `released`, never across a
	 * CUDA call or a send: an enqueuer may block in either (a caller's
	 * stream queue full behind a dead daemon) while the watcher releases.
	 */
	pthread_mutex_t seq_lock;
	struct nc__block blocks[NC__BLOCKS];
	unsigned block_count;
	bool released;           /* every slot's done word was written by us */
	pthread_t watcher;
	bool watching;
	int stop_pipe[2];
};

/* ---- checking a job here ------------------------------------------------------------ */

/* The tensor roles and each op's use of them: proto/job_roles.h, shared with the daemon. */
_Static_assert(NC_LAYERNORM_FWD == 1 && NC_LAYERNORM_BWD == 2 && NC_RMSNORM_FWD == 3 &&
		   NC_RMSNORM_BWD == 4 && NC_WGRAD_ACCUM == NC__JOB_OPS,
	       "the columns of NC__JOB_ROLE_MAP follow enum nc_op");

static bool op_is_backward(enum nc_op op)
{
	return op == NC_LAYERNORM_BWD || op == NC_RMSNORM_BWD;
}

/* What the job's op does with a role: a memory-efficient backward takes no mean. */
static enum nc__role_use role_use(const struct nc_job *job, enum nc__job_role role)
{
	if (role == NC__ROLE_MEAN && (job->flags & NC_MEMORY_EFFICIENT))
		return NC__USE_NONE;
	return nc__job_role_use(job->op, role);
}

static size_t dtype_size(enum nc_dtype dtype)
{
	return dtype == NC_F32 ? 4 : 2;
}

static bool dtype_is_fp8(enum nc_dtype dtype)
{
	return dtype == NC_F8E4M3 || dtype == NC_F8E5M2;
}

/* Whether the job's ext asks for FP8 output. */
static bool y_is_fp8(const struct nc_job_ext *ext)
{
	return ext && dtype_is_fp8(ext->y_dtype);
}

/* Elements and element size of a role (WGRAD_ACCUM is refused before this). */
static void role_shape(const struct nc_job *job, const struct nc_job_ext *ext,
		       enum nc__job_role role, uint64_t *elems, size_t *size)
{
	enum nc_dtype weights = job->weight_dtype ? job->weight_dtype : job->dtype;
	switch (role) {
	case NC__ROLE_SCALE:
	case NC__ROLE_AMAX:
		*elems = 1;
		*size = 4;
		return;
	case NC__ROLE_MEAN:
	case NC__ROLE_RSTD:
		*elems = job->rows;
		*size = 4;
		return;
	case NC__ROLE_GAMMA:
	case NC__ROLE_BETA:
	case NC__ROLE_DGAMMA:
	case NC__ROLE_DBETA:
		*elems = job->cols;
		*size = dtype_size(weights);
		return;
	default:
		*elems = job->rows * job->cols;
		*size = role == NC__ROLE_Y && y_is_fp8(ext) ? 1 : dtype_size(job->dtype);
	}
}

uint64_t nc__role_bytes(const struct nc_job *job, const struct nc_job_ext *ext, int role)
{
	uint64_t elems, bytes;
	size_t size;
	role_shape(job, ext, (enum nc__job_role)role, &elems, &size);
	if (job->op == NC_WGRAD_ACCUM || __builtin_mul_overflow(elems, (uint64_t)size, &bytes))
		return 0; /* the daemon sizes WGRAD_ACCUM's tensors (never enqueued) */
	return bytes;
}

/* One tensor's region, bounds, alignment and device; its span for the alias check. */
static int check_tensor(nc_conn *conn, const struct nc_job *job, const struct nc_job_ext *ext,
			enum nc__job_role role, struct nc_tensor t, int *device,
			struct nc__span *span)
{
	const char *name = nc__job_role_name(role);
	const nc_region *r = nc__region_find(conn, t.region);
	uint64_t elems, bytes, end;
	size_t size;
	role_shape(job, ext, role, &elems, &size);
	if (!r)
		return nc__fail(NC_ENOT_FOUND, "tensor %s: region %llu is not registered", name,
				(unsigned long long)t.region);
	if (__builtin_mul_overflow(elems, (uint64_t)size, &bytes) ||
	    __builtin_add_overflow(t.offset, bytes, &end) || end > r->size)
		return nc__fail(NC_EOUT_OF_RANGE,
				"tensor %s: offset %llu + %llu elements runs past region %llu "
				"(%zu bytes)",
				name, (unsigned long long)t.offset, (unsigned long long)elems,
				(unsigned long long)r->id, r->size);
	if (t.offset % size)
		return nc__fail(NC_EINVALID_ARGUMENT,
				"tensor %s: offset %llu is not a multiple of its element size", name,
				(unsigned long long)t.offset);
	if (*device != -2 && r->device != *device)
		return nc__fail(NC_EINVALID_ARGUMENT, "tensors live on different devices");
	*device = r->device;
	/* Where this process sees the bytes: the daemon also compares memfds by inode. */
	span->present = true;
	span->memory[0] = span->memory[1] = 0;
	span->start = (uint64_t)(uintptr_t)r->data + t.offset;
	span->bytes = bytes;
	return 0;
}

static int check_tensors(nc_conn *conn, const struct nc_job *job, const struct nc_job_ext *ext,
			 int *device)
{
	static const struct nc_job_ext none;
	if (!ext)
		ext = &none;
	/* In the order of the role table. */
	const struct nc_tensor t[NC__ROLE_COUNT] = {
		job->x,	       job->y,		  job->mean, job->rstd,	 job->gamma, job->beta,
		job->dy,       job->dx,		  job->dgamma, job->dbeta, job->main_grad,
		ext->residual, ext->residual_out, ext->ds,   ext->scale, ext->amax,
	};
	struct nc__span spans[NC__ROLE_COUNT] = {{0}};
	int rc = 0;
	*device = -2;
	pthread_mutex_lock(&conn->lock);
	for (int i = 0; i < NC__ROLE_COUNT && rc == 0; i++) {
		enum nc__job_role role = (enum nc__job_role)i;
		const char *name = nc__job_role_name(role);
		bool present = t[role].region != 0;
		if (!present && role_use(job, role) == NC__USE_REQ) {
			rc = nc__fail(NC_EINVALID_ARGUMENT, "op %d needs tensor %s", (int)job->op,
				      name);
			break;
		}
		if (!present)
			continue;
		if (role_use(job, role) == NC__USE_NONE) {
			rc = nc__fail(NC_EINVALID_ARGUMENT, "tensor %s is not used by op %d%s",
				      name, (int)job->op,
				      (job->flags & NC_MEMORY_EFFICIENT) ? " (memory-efficient)"
									 : "");
			break;
		}
		rc = check_tensor(conn, job, ext, role, t[role], device, &spans[role]);
	}
	pthread_mutex_unlock(&conn->lock);
	enum nc__job_role a, b;
	enum nc__alias verdict = rc ? NC__ALIAS_OK : nc__job_alias_check(job->op, spans, &a, &b);
	if (verdict != NC__ALIAS_OK)
		rc = nc__fail(NC_EINVALID_ARGUMENT, "tensor %s overlaps %s: %s",
			      nc__job_role_name(a), nc__job_role_name(b), nc__alias_why(verdict));
	return rc;
}

/* The variants' own rules (the daemon's and nk_norm_check's), and whether the daemon runs them. */
static int check_ext(nc_conn *conn, const struct nc_job *job, const struct nc_job_ext *ext)
{
	int rc = nc__job_ext_check(ext);
	if (rc || !ext)
		return rc;
	bool bwd = op_is_backward(job->op), fp8 = y_is_fp8(ext);
	if (ext->y_dtype && ext->y_dtype != job->dtype && !fp8)
		return nc__fail(NC_EINVALID_ARGUMENT, "y_dtype %d must be 0, dtype or FP8",
				(int)ext->y_dtype);
	if (fp8 && bwd)
		return nc__fail(NC_EINVALID_ARGUMENT, "FP8 output (y_dtype) applies to forward ops");
	if (fp8 != (ext->scale.region != 0) || (ext->amax.region && !fp8))
		return nc__fail(NC_EINVALID_ARGUMENT,
				"FP8 output (y_dtype) needs scale; scale and amax go with it only");
	if (!bwd && (ext->residual.region != 0) != (ext->residual_out.region != 0))
		return nc__fail(NC_EINVALID_ARGUMENT, "residual and residual_out go together");
	if (!isfinite(ext->weight_offset) || (ext->weight_offset != 0.0f && !job->gamma.region))
		return nc__fail(NC_EINVALID_ARGUMENT,
				"weight_offset must be finite, and needs gamma (got %g)",
				(double)ext->weight_offset);
	uint32_t used = (ext->weight_offset != 0.0f ? NC_FEATURE_WEIGHT_OFFSET : 0u) |
			(fp8 ? NC_FEATURE_FP8_OUTPUT : 0u) |
			((bwd ? ext->ds.region : ext->residual.region) ? NC_FEATURE_RESIDUAL : 0u);
	uint32_t missing = used & ~conn->norm_features;
	if (missing)
		return nc__fail(NC_EUNSUPPORTED,
				"the daemon's %s backend does not run these variants (features 0x%x "
				"missing; nc_server_norm_features)",
				conn->info.backend, missing);
	return 0;
}

/* What the daemon would refuse, refused here so that the error is synchronous. */
static int check_job(nc_conn *conn, const struct nc_job *job, const struct nc_job_ext *ext,
		     int *device)
{
	uint64_t elems;
	if (job->op < NC_LAYERNORM_FWD || job->op > NC_RMSNORM_BWD)
		return nc__fail(job->op == NC_WGRAD_ACCUM ? NC_EUNSUPPORTED : NC_EINVALID_ARGUMENT,
				"op %d cannot be enqueued (LayerNorm and RMSNorm only)", (int)job->op);
	if (job->dtype < NC_F32 || job->dtype > NC_BF16)
		return nc__fail(NC_EINVALID_ARGUMENT, "dtype %d is not F32, F16 or BF16",
				(int)job->dtype);
	if (job->weight_dtype && job->weight_dtype != job->dtype && job->weight_dtype != NC_F32)
		return nc__fail(dtype_is_fp8(job->weight_dtype) ? NC_EINVALID_ARGUMENT
								: NC_EUNSUPPORTED,
				"weight_dtype must match dtype or be F32");
	if (job->rows == 0 || job->cols == 0)
		return nc__fail(NC_EINVALID_ARGUMENT, "rows and cols must be at least 1");
	if (job->rows > INT64_MAX || __builtin_mul_overflow(job->rows, job->cols, &elems) ||
	    elems > INT64_MAX / 8)
		return nc__fail(NC_EOUT_OF_RANGE, "rows*cols overflows (rows %llu, cols %llu)",
				(unsigned long long)job->rows, (unsigned long long)job->cols);
	if (!job->gamma.region && (job->beta.region || job->dgamma.region || job->dbeta.region))
		return nc__fail(NC_EINVALID_ARGUMENT, "beta, dgamma and dbeta need gamma");
	if (job->eps < 0.0f || !isfinite(job->eps))
		return nc__fail(NC_EINVALID_ARGUMENT, "eps must be positive and finite (got %g)",
				(double)job->eps);
	if ((job->flags & ~(unsigned)(NC_MEMORY_EFFICIENT | NC_ACCUMULATE)) ||
	    (job->flags && !op_is_backward(job->op)))
		return nc__fail(NC_EINVALID_ARGUMENT,
				"flags 0x%x: memory_efficient and accumulate apply to backward ops",
				job->flags);
	int rc = check_ext(conn, job, ext);
	return rc ? rc : check_tensors(conn, job, ext, device);
}

/* ---- semaphore blocks --------------------------------------------------------------- */

static struct nc__enqueue *enqueue_of(nc_conn *conn)
{
	pthread_mutex_lock(&conn->lock);
	if (!conn->enqueue) {
		struct nc__enqueue *e = nc__calloc(1, sizeof(*e));
		if (e) {
			pthread_mutex_init(&e->lock, NULL);
			pthread_mutex_init(&e->seq_lock, NULL);
			e->stop_pipe[0] = e->stop_pipe[1] = -1;
		}
		conn->enqueue = e;
	}
	struct nc__enqueue *e = conn->enqueue;
	pthread_mutex_unlock(&conn->lock);
	return e;
}

/* Registers the block's memfd with CUDA: the caller's GPU writes ready and waits on done there. */
static int block_create_device(struct nc__block *b, int device)
{
	int previous = 0;
	cudaGetDevice(&previous);
	void *gpu_view = NULL;
	bool registered = cudaSetDevice(device) == cudaSuccess &&
			  cudaHostRegister(b->ready_host, NC__SLOTS * NC__SLOT_BYTES,
					   cudaHostRegisterMapped | cudaHostRegisterPortable) ==
				  cudaSuccess;
	if (!registered || cudaHostGetDevicePointer(&gpu_view, b->ready_host, 0) != cudaSuccess) {
		cudaError_t err = cudaGetLastError();
		if (registered)
			cudaHostUnregister(b->ready_host);
		cudaSetDevice(previous);
		return nc__fail(NC_ERESOURCE_EXHAUSTED,
				"cannot set up semaphore words on device %d: %s", device,
				cudaGetErrorString(err));
	}
	cudaSetDevice(previous);
	b->ready_gpu = gpu_view;
	return 0;
}

/* The block of `device` (conn's enqueue lock held), made on first use. */
static int block_for(nc_conn *conn, struct nc__enqueue *e, int device, struct nc__block **out)
{
	for (unsigned i = 0; i < e->block_count; i++) {
		if (e->blocks[i].device == device) {
			*out = &e->blocks[i];
			return 0;
		}
	}
	if (e->block_count == NC__BLOCKS)
		return nc__fail(NC_ERESOURCE_EXHAUSTED, "enqueue on more than %d devices", NC__BLOCKS);
	struct nc__block *b = &e->blocks[e->block_count];
	memset(b, 0, sizeof(*b));
	b->device = device;
	int rc = nc_region_alloc_host(conn, NC__SLOTS * NC__SLOT_BYTES, &b->ready_region);
	if (rc)
		return rc;
	b->ready_host = nc_region_data(b->ready_region);
	if (device >= 0 && (rc = block_create_device(b, device)) != 0) {
		nc_region_free(b->ready_region);
		return rc;
	}
	e->block_count++;
	*out = b;
	return 0;
}

static struct nc__slot *slot_for(struct nc__block *b, void *key, bool create)
{
	struct nc__slot *free_slot = NULL;
	for (unsigned i = 0; i < NC__SLOTS; i++) {
		if (b->slots[i].used && b->slots[i].key == key)
			return &b->slots[i];
		if (!b->slots[i].used && !free_slot)
			free_slot = &b->slots[i];
	}
	if (!create || !free_slot)
		return NULL;
	free_slot->used = true;
	free_slot->key = key;
	return free_slot;
}

static size_t slot_offset(const struct nc__block *b, const struct nc__slot *slot)
{
	return (size_t)(slot - b->slots) * NC__SLOT_BYTES;
}

/* The slot's done word as the CPU reaches it. */
static uint8_t *slot_done(struct nc__block *b, const struct nc__slot *slot)
{
	return b->ready_host + slot_offset(b, slot) + NC__DONE_OFFSET;
}

/* Stores done = seq from the CPU: releases whatever waits on it, GPU or CPU. */
static void store_done(uint8_t *done, uint32_t seq)
{
	atomic_store_explicit((_Atomic uint32_t *)done, seq, memory_order_release);
}

/* Stores done = the latest seq issued on every slot: no caller stream waits on us any more. */
static void release_all_slots(struct nc__enqueue *e)
{
	pthread_mutex_lock(&e->seq_lock);
	e->released = true; /* enqueuers from now on release their own seq */
	for (unsigned i = 0; i < e->block_count; i++) {
		struct nc__block *b = &e->blocks[i];
		for (unsigned k = 0; k < NC__SLOTS; k++) {
			if (b->slots[k].used && b->slots[k].seq)
				store_done(slot_done(b, &b->slots[k]), b->slots[k].seq);
		}
	}
	pthread_mutex_unlock(&e->seq_lock);
}

/* ---- the watcher: releases the streams when the daemon goes away --------------------- */

static void *watcher_main(void *arg)
{
	nc_conn *conn = arg;
	struct nc__enqueue *e = conn->enqueue;
	struct pollfd fds[2] = {{.fd = conn->fd, .events = POLLRDHUP},
				{.fd = e->stop_pipe[0], .events = POLLIN}};
	for (;;) {
		int n = poll(fds, 2, -1);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 || fds[1].revents)
			return NULL;
		if (fds[0].revents & (POLLRDHUP | POLLHUP | POLLERR))
			break;
	}
	pthread_mutex_lock(&conn->lock);
	if (!conn->broken) {
		conn->broken = NC_EDISCONNECTED;
		snprintf(conn->broken_message, sizeof(conn->broken_message),
			 "normd closed the connection");
	}
	pthread_cond_broadcast(&conn->cond);
	pthread_mutex_unlock(&conn->lock);
	release_all_slots(e); /* without e->lock: an enqueuer may be stuck holding it */
	return NULL;
}

static void watcher_start(nc_conn *conn, struct nc__enqueue *e)
{
	if (e->watching || pipe2(e->stop_pipe, O_CLOEXEC) != 0)
		return;
	e->watching = pthread_create(&e->watcher, NULL, watcher_main, conn) == 0;
}

void nc__enqueue_stop(nc_conn *conn)
{
	struct nc__enqueue *e = conn->enqueue;
	if (!e || !e->watching)
		return;
	ssize_t ignored = write(e->stop_pipe[1], "x", 1);
	(void)ignored;
	pthread_join(e->watcher, NULL);
	e->watching = false;
}

void nc__enqueue_release(nc_conn *conn)
{
	struct nc__enqueue *e = conn->enqueue;
	if (!e)
		return;
	if (!e->released)
		release_all_slots(e);
	for (unsigned i = 0; i < e->block_count; i++) {
		struct nc__block *b = &e->blocks[i];
		if (b->device < 0)
			continue; /* host regions: released with the others */
		/*
		 * The caller's streams may not have reached their last ready
		 * writes and done waits yet (all released now): the page must
		 * stay mapped for the GPU until they have.
		 */
		int previous = 0;
		cudaGetDevice(&previous);
		if (cudaSetDevice(b->device) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)
			cudaGetLastError();
		cudaHostUnregister(b->ready_host);
		cudaSetDevice(previous);
	}
	for (int i = 0; i < 2; i++) {
		if (e->stop_pipe[i] >= 0)
			close(e->stop_pipe[i]);
	}
	pthread_mutex_destroy(&e->lock);
	pthread_mutex_destroy(&e->seq_lock);
	nc__free(e);
	conn->enqueue = NULL;
}

/* ---- asynchronous errors -------------------------------------------------------------- */

void nc__enqueue_answered(nc_conn *conn, const Normd__Envelope *env)
{
	int status = NC_EPROTOCOL_ERROR;
	const char *message = "unexpected reply to an enqueued job";
	if (env->body_case == NORMD__ENVELOPE__BODY_JOB_REPLY) {
		status = nc__status_from_wire(env->job_reply->status);
		message = env->job_reply->message;
	} else if (env->body_case == NORMD__ENVELOPE__BODY_RESULT) {
		status = nc__status_from_wire(env->result->status);
		message = env->result->message;
	}
	if (status == NC_OK || conn->async_status != NC_OK)
		return; /* the first error is kept until it is reported */
	conn->async_status = status;
	snprintf(conn->async_message, sizeof(conn->async_message),
		 "enqueued request %llu failed: %s", (unsigned long long)env->request_id,
		 message ? message : nc_strerror(status));
}

/* The error an enqueue-mode call reports before anything else, or 0. */
static int pending_error(nc_conn *conn)
{
	int rc = 0;
	pthread_mutex_lock(&conn->lock);
	if (conn->async_status) {
		rc = nc__fail(conn->async_status, "%s", conn->async_message);
		conn->async_status = 0;
	} else if (conn->broken) {
		rc = nc__fail(NC_EDISCONNECTED, "%s", conn->broken_message);
	}
	pthread_mutex_unlock(&conn->lock);
	return rc;
}

/* ---- the calls ---------------------------------------------------------------------- */

/*
 * The driver's stream calls need a current context, which a thread that has
 * made no runtime call yet lacks (PyTorch's autograd threads, for one):
 * bind the device's primary context for the call, then give the thread its
 * device back.
 */
static int signal_wait_with_context(struct nc__block *b, void *stream, void *ready, void *done,
				    uint32_t seq)
{
	int previous = 0;
	cudaGetLastError();
	if (cudaGetDevice(&previous) != cudaSuccess || cudaSetDevice(b->device) != cudaSuccess)
		return -1;
	int rc = nk_cuda_stream_signal_wait(stream, ready, seq, done, seq);
	cudaSetDevice(previous);
	return rc;
}

/*
 * NC_EUNSUPPORTED if the CUDA stream is capturing a graph, else 0 (a query
 * that fails says no: the stream operations that follow fail and say why).
 */
int nc__refuse_capture(void *stream)
{
	enum cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
	if (cudaStreamIsCapturing((cudaStream_t)stream, &status) != cudaSuccess) {
		cudaGetLastError();
		return 0;
	}
	if (status == cudaStreamCaptureStatusNone)
		return 0;
	return nc__fail(NC_EUNSUPPORTED,
			"the stream is capturing a CUDA graph, and a normd job cannot be "
			"captured: every replay would run the graph's kernels and skip the job");
}

/* Forgets an enqueued request id that never went out. */
static void forget_request(nc_conn *conn, uint64_t id)
{
	pthread_mutex_lock(&conn->lock);
	nc__idset_remove(&conn->enqueued, id);
	pthread_mutex_unlock(&conn->lock);
}

/*
 * Queues the stream side of one job and sends it; the enqueue lock is held.
 * Whatever can fail while the daemon is alive (the request's id, its frame)
 * is done before the stream waits for seq: a done word stored by us while
 * the daemon still runs the slot's earlier jobs would let the stream read
 * their outputs early, and the daemon's later write would move it back.
 */
static int enqueue_locked(nc_conn *conn, struct nc__enqueue *e, struct nc__block *b,
			  struct nc__slot *slot, const struct nc_job *job,
			  const struct nc_job_ext *ext, void *stream)
{
	uint32_t seq = slot->seq + 1;
	size_t offset = slot_offset(b, slot);
	Normd__Job msg;
	Normd__Tensor ts[NC__JOB_TENSORS];
	nc__job_to_msg(job, ext, &msg, ts);
	Normd__Enqueue enq = NORMD__ENQUEUE__INIT;
	enq.sem_region = nc_region_id(b->ready_region);
	enq.sem_offset = offset;
	enq.seq = seq;
	enq.has_done_region = enq.has_done_offset = true;
	enq.done_region = enq.sem_region;
	enq.done_offset = offset + NC__DONE_OFFSET;
	enq.has_device = b->device >= 0;
	enq.device = b->device;
	msg.enqueue = &enq;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.body_case = NORMD__ENVELOPE__BODY_JOB;
	env.job = &msg;
	pthread_mutex_lock(&conn->lock);
	uint64_t id = ++conn->next_request_id;
	int rc = nc__idset_add(&conn->enqueued, id);
	pthread_mutex_unlock(&conn->lock);
	if (rc)
		return rc;
	env.has_request_id = true;
	env.request_id = id;
	uint8_t *frame = NULL;
	size_t len = 0;
	if ((rc = nc__pack(conn, &env, &frame, &len)) != 0) {
		forget_request(conn, id);
		return rc;
	}
	uint8_t *ready_gpu = b->device < 0 ? NULL : b->ready_gpu + offset;
	uint8_t *done_gpu = ready_gpu ? ready_gpu + NC__DONE_OFFSET : NULL;
	if (b->device < 0) {
		atomic_store_explicit((_Atomic uint32_t *)(b->ready_host + offset), seq,
				      memory_order_release);
	} else if (nk_cuda_stream_signal_wait(stream, ready_gpu, seq, done_gpu, seq) != 0 &&
		   signal_wait_with_context(b, stream, ready_gpu, done_gpu, seq) != 0) {
		cudaGetLastError();
		nc__free(frame);
		forget_request(conn, id);
		return nc__fail(NC_EINVALID_ARGUMENT,
				"cannot queue the semaphore operations on the caller's stream");
	}
	/* The stream waits for seq now: the watcher releases it from here on. */
	pthread_mutex_lock(&e->seq_lock);
	slot->seq = seq;
	bool released = e->released;
	pthread_mutex_unlock(&e->seq_lock);
	rc = released ? nc__fail(NC_EDISCONNECTED, "the connection to normd is gone")
		      : nc__send_packed(conn, frame, len);
	nc__free(frame);
	if (rc == 0)
		return 0;
	/* Only a lost connection fails here: release the stream as the watcher would. */
	forget_request(conn, id);
	store_done(slot_done(b, slot), seq);
	return rc == NC_EIO ? nc__fail(NC_EDISCONNECTED, "%s", nc_last_error()) : rc;
}

NC_API int nc_job_enqueue(nc_conn *conn, const struct nc_job *job, void *stream)
{
	return nc_job_enqueue_ext(conn, job, NULL, stream);
}

NC_API int nc_job_enqueue_ext(nc_conn *conn, const struct nc_job *job,
			      const struct nc_job_ext *ext, void *stream)
{
	return nc__job_enqueue(conn, job, ext, stream, false);
}

int nc__job_enqueue(nc_conn *conn, const struct nc_job *job, const struct nc_job_ext *ext,
		    void *stream, bool capture_checked)
{
	if (!conn || !job)
		return nc__fail(NC_EINVALID_ARGUMENT, "conn and job must not be NULL");
	nc__poll_replies(conn);
	int rc = pending_error(conn);
	int device = -1;
	if (rc == 0)
		rc = check_job(conn, job, ext, &device);
	/* Before a stream slot is taken: a CUDA stream's job only (a CPU key is no stream). */
	if (rc == 0 && device >= 0 && !capture_checked)
		rc = nc__refuse_capture(stream);
	struct nc__enqueue *e = rc ? NULL : enqueue_of(conn);
	if (rc == 0 && !e)
		rc = nc__fail(NC_ENOMEM, "out of memory for the enqueue mode");
	if (rc)
		return rc;
	pthread_mutex_lock(&e->lock);
	struct nc__block *b = NULL;
	struct nc__slot *slot = NULL;
	pthread_mutex_lock(&e->seq_lock);
	if (e->released)
		rc = nc__fail(NC_EDISCONNECTED, "the connection to normd is gone");
	pthread_mutex_unlock(&e->seq_lock);
	if (rc == 0)
		rc = block_for(conn, e, device, &b);
	if (rc == 0 && !(slot = slot_for(b, stream, true)))
		rc = nc__fail(NC_ERESOURCE_EXHAUSTED,
			      "more than %d streams enqueue on device %d of this connection",
			      NC__SLOTS, device);
	if (rc == 0)
		rc = enqueue_locked(conn, e, b, slot, job, ext, stream);
	if (rc == 0)
		watcher_start(conn, e);
	pthread_mutex_unlock(&e->lock);
	return rc;
}

NC_API int nc_conn_check(nc_conn *conn, int timeout_ms)
{
	if (!conn)
		return nc__fail(NC_EINVALID_ARGUMENT, "conn is NULL");
	int rc = nc__await_enqueued(conn, timeout_ms);
	int pending = pending_error(conn);
	return pending ? pending : rc;
}

static int64_t now_us(void)
{
	return (int64_t)(nc__now_ns() / 1000);
}

/* Whether the jobs of `stream` are done: the key's done word (host), or the stream idle (CUDA). */
static int stream_idle(nc_conn *conn, void *stream, bool *idle)
{
	struct nc__enqueue *e = conn->enqueue;
	*idle = true;
	if (!e)
		return 0;
	pthread_mutex_lock(&e->lock);
	bool host = false;
	uint32_t target = 0;
	const uint8_t *done = NULL;
	for (unsigned i = 0; i < e->block_count && !done; i++) {
		struct nc__slot *slot = slot_for(&e->blocks[i], stream, false);
		if (slot && e->blocks[i].device < 0) {
			host = true;
			target = slot->seq;
			done = slot_done(&e->blocks[i], slot);
		}
	}
	pthread_mutex_unlock(&e->lock);
	if (host) {
		uint32_t now = atomic_load_explicit((_Atomic uint32_t *)done, memory_order_acquire);
		*idle = (int32_t)(now - target) >= 0;
		return 0;
	}
	if (e->block_count == 0 || e->blocks[0].device < 0)
		return 0;
	cudaError_t state = cudaStreamQuery((cudaStream_t)stream);
	if (state == cudaErrorNotReady) {
		*idle = false;
		return 0;
	}
	if (state != cudaSuccess) {
		cudaGetLastError();
		return nc__fail(NC_EINVALID_ARGUMENT, "cudaStreamQuery: %s", cudaGetErrorString(state));
	}
	return 0;
}

NC_API int nc_stream_wait(nc_conn *conn, void *stream, int timeout_ms)
{
	if (!conn)
		return nc__fail(NC_EINVALID_ARGUMENT, "conn is NULL");
	int64_t start = now_us(), pause_us = 1;
	for (;;) {
		bool idle = false;
		int rc = stream_idle(conn, stream, &idle);
		if (rc)
			return rc;
		if (idle)
			break;
		int64_t waited = now_us() - start;
		if (timeout_ms >= 0 && waited >= (int64_t)timeout_ms * 1000)
			return nc__fail(NC_ETIMEOUT, "the stream's jobs did not finish within %d ms",
					timeout_ms);
		/* Poll fast for short jobs, then back off to a millisecond. */
		struct timespec ts = {0, pause_us * 1000};
		nanosleep(&ts, NULL);
		pause_us = pause_us < 1000 ? pause_us * 2 : 1000;
	}
	int64_t left = timeout_ms < 0 ? -1 : timeout_ms - (now_us() - start) / 1000;
	return nc_conn_check(conn, left < 0 && timeout_ms >= 0 ? 0 : (int)left);
}
