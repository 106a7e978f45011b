/*
 * libnormclient: the client library of normd, the GPU normalization service.
 *
 * A process connects to normd over a Unix socket, registers the memory it
 * wants jobs to read and write (host memory shared through memfd on the CPU
 * backend), and submits LayerNorm / RMSNorm forward and backward jobs that
 * name tensors as (region, offset) pairs. Nothing is copied between
 * processes: the daemon reads and writes the registered memory in place.
 *
 * Errors: every action function returns 0 (NC_OK) or a negative NC_E* code
 * from the table below; nc_strerror() names it and nc_last_error() gives the
 * daemon's (or the library's) one-line explanation of the latest failure.
 *
 * Threads: one nc_conn may be used from several threads at once. Sends are
 * serialized by a lock; whichever thread waits for a reply reads the socket
 * and hands replies meant for other threads over to them. Each region must
 * be freed by one thread, after the last job using it has completed.
 * nc_last_error() is per thread: it reports the last failure of the calling
 * thread on any connection.
 */
#ifndef NORMCLIENT_H
#define NORMCLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define NC_API __attribute__((visibility("default")))
#else
#define NC_API
#endif

/*
 * The status table, shared with the daemon and the wire protocol: the wire
 * Status value of NAME is N, the library returns NC_E##NAME == -N. Codes at
 * 100 and above are the library's own and never travel on the wire.
 */
#define NC_STATUS_MAP(X)                                                                \
	X(INVALID_ARGUMENT, 1, "invalid argument")                                      \
	X(OUT_OF_RANGE, 2, "out of range")                                              \
	X(NOT_FOUND, 3, "not found")                                                    \
	X(ALREADY_EXISTS, 4, "already exists")                                          \
	X(RESOURCE_EXHAUSTED, 5, "resource exhausted")                                  \
	X(UNSUPPORTED, 6, "unsupported")                                                \
	X(PROTOCOL_ERROR, 7, "protocol error")                                          \
	X(SHUTTING_DOWN, 8, "server is shutting down")                                  \
	X(DEVICE_ERROR, 9, "device error")                                              \
	X(INTERNAL, 10, "internal error")                                               \
	X(IO, 100, "connection I/O error")                                              \
	X(TIMEOUT, 101, "timed out")                                                    \
	X(NOMEM, 102, "out of memory")                                                  \
	X(DISCONNECTED, 103, "disconnected from normd")

enum nc_status {
	NC_OK = 0,
#define NC__STATUS_ENUM(name, value, text) NC_E##name = -(value),
	NC_STATUS_MAP(NC__STATUS_ENUM)
#undef NC__STATUS_ENUM
};

/* A static name for a status ("ok", "invalid argument", ...). Any thread. */
NC_API const char *nc_strerror(int status);

/* The NC_STATUS_MAP name of a status ("OK", "INVALID_ARGUMENT", ...). */
NC_API const char *nc_status_name(int status);

/*
 * The one-line explanation of the calling thread's latest failed call (the
 * daemon's message when the daemon refused it). Valid until the same thread
 * calls the library again. Never NULL.
 */
NC_API const char *nc_last_error(void);

typedef struct nc_conn nc_conn;
typedef struct nc_region nc_region;

/* ---- connection ------------------------------------------------------------ */

/*
 * Connects to the daemon at `socket_path` and exchanges Hello. Waits at most
 * `timeout_ms` for the connection and the reply (< 0: no limit).
 * `client_name` (may be NULL) appears in the daemon's logs.
 * On success *out owns the connection; release it with nc_close().
 * Errors: NC_EINVALID_ARGUMENT, NC_EIO (no daemon there), NC_ETIMEOUT,
 * NC_EPROTOCOL_ERROR (version refused), NC_ENOMEM.
 */
NC_API int nc_connect(const char *socket_path, const char *client_name, int timeout_ms,
		      nc_conn **out);

/*
 * Says Goodbye, closes the socket and frees the connection. Regions still
 * registered are released by the daemon once their jobs end; their local
 * mappings are unmapped and their nc_region handles freed here, so none may
 * be used afterwards. Accepts NULL. Call it once, from one thread, when no
 * other thread uses the connection.
 */
NC_API void nc_close(nc_conn *conn);

/* What the daemon said about itself in its HelloReply. Owned by the connection. */
struct nc_server_info {
	char version[32];
	char backend[16];      /* "cpu" or "cuda" */
	uint32_t server_pid;
	uint32_t max_frame;
	uint32_t max_regions;
	uint32_t max_jobs_in_flight;
	uint64_t max_mapped_bytes;
	uint32_t device_count;
	int device_index[16];  /* CUDA ordinals served (-1: the host, cpu backend) */
	bool mps;              /* the daemon's CUDA contexts run under NVIDIA MPS */
};
NC_API const struct nc_server_info *nc_server_info(const nc_conn *conn);

/* Round trip with no work. Errors: NC_EIO, NC_ETIMEOUT. */
NC_API int nc_ping(nc_conn *conn, int timeout_ms);

/* ---- regions --------------------------------------------------------------- */

/*
 * Creates `size` bytes of shared host memory (memfd), maps it here and
 * registers it with the daemon (CPU backend). The memory starts zeroed.
 * On success *out owns the region; free it with nc_region_free().
 * Errors: NC_EINVALID_ARGUMENT (size 0), NC_ENOMEM, NC_EIO, and the daemon's
 * refusals (NC_ERESOURCE_EXHAUSTED past its limits, NC_EUNSUPPORTED on a
 * backend without host regions).
 */
NC_API int nc_region_alloc_host(nc_conn *conn, size_t size, nc_region **out);

/*
 * Registers an existing memfd (or any mmap-able fd) of at least `size` bytes
 * and maps it here. The library dups `fd`; the caller keeps its own.
 */
NC_API int nc_region_register_fd(nc_conn *conn, int fd, size_t size, nc_region **out);

/*
 * Unregisters the region and unmaps it. The daemon keeps its own mapping
 * until jobs already submitted on the region have completed, so calling this
 * with jobs in flight is safe for the daemon but leaves their results unseen.
 * Accepts NULL. Errors: those of the daemon's reply (the local mapping is
 * released regardless).
 */
NC_API int nc_region_free(nc_region *region);

/*
 * Registers the device memory that contains device pointer `ptr` (CUDA
 * backend) and returns it as a region; tensors are offsets from its start
 * (nc_tensor_at with device pointers works). Two kinds of memory:
 * - cudaMalloc memory (and allocators built on it, such as PyTorch's caching
 *   allocator): the whole allocation, exported as a CUDA IPC handle of its
 *   base. The daemon must not run in the calling process.
 * - VMM memory (cuMemCreate allocations mapped with cuMemMap, such as
 *   PyTorch's PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) created with
 *   the POSIX file descriptor handle type: the one mapping that contains
 *   `ptr` (nc_region_register_device_range for more), each mapping exported
 *   as a POSIX fd and mapped by the daemon as it is here. The region starts
 *   at the mapping's start.
 * Refused with NC_EUNSUPPORTED and a message: cudaMallocAsync/memory-pool
 * memory, managed memory, and VMM memory that cannot be exported as a POSIX
 * fd. Free with nc_region_free().
 */
NC_API int nc_region_register_device(nc_conn *conn, const void *ptr, nc_region **out);

/* Most VMM mappings (cuMemCreate chunks) one region may span. */
#define NC_VMM_MAX_CHUNKS 64

/*
 * nc_region_register_device() for the `bytes` bytes from `ptr`: cudaMalloc
 * memory registers the whole allocation (the range must lie inside it); VMM
 * memory registers the consecutive mappings that cover [ptr, ptr + bytes),
 * at most NC_VMM_MAX_CHUNKS of them (more: NC_EUNSUPPORTED, saying how many;
 * a range that runs into unmapped addresses: NC_EINVALID_ARGUMENT). The
 * region must not outlive those mappings' use: the daemon keeps the memory
 * mapped (and so allocated) until the region is freed.
 */
NC_API int nc_region_register_device_range(nc_conn *conn, const void *ptr, size_t bytes,
					   nc_region **out);


NC_API void *nc_region_data(const nc_region *region); /* local mapping */
NC_API size_t nc_region_size(const nc_region *region);
NC_API uint64_t nc_region_id(const nc_region *region);

/* ---- jobs ------------------------------------------------------------------ */

enum nc_op {
	NC_LAYERNORM_FWD = 1,
	NC_LAYERNORM_BWD = 2,
	NC_RMSNORM_FWD = 3,
	NC_RMSNORM_BWD = 4,
	NC_WGRAD_ACCUM = 5,
};

enum nc_dtype {
	NC_F32 = 1,
	NC_F16 = 2,
	NC_BF16 = 3,
	NC_F8E4M3 = 4, /* FP8 (OCP) for nc_job_ext.y_dtype only: max 448, no infinities */
	NC_F8E5M2 = 5, /* FP8 (OCP) for nc_job_ext.y_dtype only: max finite 57344 */
};

enum nc_job_flags {
	NC_MEMORY_EFFICIENT = 1u << 0, /* backward reads y (in .x) instead of x */
	NC_ACCUMULATE = 1u << 1,       /* dgamma/dbeta += instead of = */
	NC_OVERWRITE = 1u << 2,        /* NC_WGRAD_ACCUM: main_grad = instead of += */
};

/* A tensor is a byte offset into a registered region; region 0 means absent. */
struct nc_tensor {
	uint64_t region;
	uint64_t offset;
};

/*
 * One job. Which tensors an op reads and writes (absent = region 0):
 *   NC_LAYERNORM_FWD  in: x, gamma?, beta?         out: y, mean?, rstd?
 *   NC_RMSNORM_FWD    in: x, gamma?                out: y, rstd?
 *   NC_LAYERNORM_BWD  in: dy, x (y if NC_MEMORY_EFFICIENT), mean (not with
 *                     NC_MEMORY_EFFICIENT), rstd, gamma?, beta?
 *                     out: dx, dgamma?, dbeta?
 *   NC_RMSNORM_BWD    in: dy, x (or y), rstd, gamma?   out: dx, dgamma?
 *   NC_WGRAD_ACCUM    main_grad[out, in] += dy^T x  (= with NC_OVERWRITE), with
 *                     rows = tokens, cols = in, out_features = out; x is
 *                     [tokens, in] and dy [tokens, out] of `dtype`, main_grad
 *                     [out, in] of `weight_dtype` (0 here means NC_F32).
 * x, y, dy, dx are [rows, cols] of `dtype`; gamma, beta, dgamma, dbeta are
 * [cols] of `weight_dtype` (0: same as dtype; else NC_F32); mean and rstd
 * are [rows] of fp32. eps 0 means the default 1e-5. The norm variants
 * (residual add, weight offset, FP8 output) and the in-place forms are
 * struct nc_job_ext, below.
 */
struct nc_job {
	enum nc_op op;
	uint64_t rows;
	uint64_t cols;
	float eps;
	enum nc_dtype dtype;
	enum nc_dtype weight_dtype;
	unsigned flags;       /* enum nc_job_flags */
	uint64_t deadline_us; /* 0: none */
	struct nc_tensor x, y, mean, rstd, gamma, beta, dy, dx, dgamma, dbeta;
	uint64_t out_features;      /* NC_WGRAD_ACCUM only */
	struct nc_tensor main_grad; /* NC_WGRAD_ACCUM only */
};

/*
 * The norm variants of a job (protocol 3; docs/VARIANTS.md), given beside
 * struct nc_job to the *_ext calls below (struct nc_job keeps its layout,
 * so programs and bindings built against older headers keep working). A
 * zeroed struct is the plain norm. For NC_LAYERNORM_* and NC_RMSNORM_*:
 *
 *   residual add   forward: residual and residual_out together, [rows,
 *                  cols] of dtype. s = x + residual, rounded once to dtype,
 *                  is written to residual_out and normalized: y = norm(s).
 *                  Backward: pass s (residual_out) as x, and ds (optional,
 *                  [rows, cols] of dtype), the gradient arriving at s; dx =
 *                  dnorm(s) + ds is the gradient of both x and residual.
 *   weight_offset  the weight is weight_offset + gamma, formed in fp32
 *                  (never rounded to weight_dtype): 1.0f is Megatron's
 *                  apply_layernorm_1p / TransformerEngine's
 *                  zero_centered_gamma and Gemma's (1 + w). Needs gamma;
 *                  dgamma is unchanged (the offset is a constant).
 *   FP8 output     forward: y_dtype NC_F8E4M3 or NC_F8E5M2 (0: dtype), with
 *                  scale ([1] fp32, read by the daemon): y is stored as
 *                  saturate(round_to_nearest_even(y * scale)) (e4m3 +-448,
 *                  e5m2 +-57344, infinities saturate, NaN stays NaN); amax
 *                  (optional, [1] fp32) gets max |y| before scaling, NaN
 *                  elements skipped.
 *
 * In-place forms: an output may be exactly the same bytes (region, offset
 * and size) as an input when both are per-row tensors: y or residual_out
 * over x or residual (vLLM's fused_add_rms_norm: y over x, s over
 * residual), dx over x, dy or ds. Any other overlap of an output with a
 * tensor is refused with NC_EINVALID_ARGUMENT. `reserved` must be zero.
 */
struct nc_job_ext {
	struct nc_tensor residual, residual_out; /* forward residual add */
	struct nc_tensor ds;                     /* backward: gradient at s */
	struct nc_tensor scale, amax;            /* FP8 output */
	float weight_offset;                     /* 0: none; 1: zero-centered gamma */
	enum nc_dtype y_dtype;                   /* forward: 0 (dtype) or NC_F8E4M3/E5M2 */
	uint64_t reserved[4];                    /* zero: room for later fields */
};

/* The variants a backend runs, as nc_server_norm_features() reports them. */
enum nc_norm_features {
	NC_FEATURE_RESIDUAL = 1u << 0,      /* residual, residual_out, ds */
	NC_FEATURE_WEIGHT_OFFSET = 1u << 1, /* weight_offset */
	NC_FEATURE_FP8_OUTPUT = 1u << 2,    /* y_dtype NC_F8E4M3 / NC_F8E5M2 */
};

/*
 * The variants (enum nc_norm_features) the daemon's backend runs; a job
 * using another is refused with NC_EUNSUPPORTED. 0 from a daemon older than
 * protocol 3. Any thread.
 */
NC_API uint32_t nc_server_norm_features(const nc_conn *conn);

/* A tensor at host pointer `ptr` inside `region`'s local mapping. */
NC_API struct nc_tensor nc_tensor_at(const nc_region *region, const void *ptr);

/*
 * The tensor for device pointer `ptr`, registering its memory on first use;
 * later calls for the same memory reuse that registration. cudaMalloc
 * memory is cached per connection by the driver's allocation id, so memory
 * freed and allocated again at the same address is registered anew. VMM
 * memory (see nc_region_register_device) is registered by the mappings
 * that cover the tensor and, with nc_tensor_device_range(), up to 32 mapped
 * neighbours; a registration serves a tensor that lies in it only while the
 * mappings the tensor covers are still the physical allocations they were
 * registered with (the driver's memory block id, address and size): a
 * chunk unmapped and created again at the same address is registered anew,
 * never served from the stale registration. With nc_tensor_device(), which
 * knows only the first byte, every mapping of the registration must be.
 * Such regions belong to the connection: those whose memory has been freed
 * or remapped are unregistered when new memory is registered and, for VMM
 * memory, at least every 100 ms while the connection is used (so the
 * daemon's mapping does not keep freed memory alive), and nc_close()
 * releases the rest. A tensor returned here is meant for the next job: a
 * registration may go once its memory, or a neighbouring mapping's, has
 * changed. NULL gives the absent tensor. Any thread. nc_tensor_device()
 * knows only the tensor's first byte: for VMM memory, where a tensor may
 * span several mappings, use nc_tensor_device_range().
 */
NC_API int nc_tensor_device(nc_conn *conn, const void *ptr, struct nc_tensor *out);

/*
 * nc_tensor_device() for a tensor of `bytes` bytes at `ptr` (0 counts as 1):
 * the registration it returns covers all of them. Errors as
 * nc_region_register_device_range()'s. Any thread.
 */
NC_API int nc_tensor_device_range(nc_conn *conn, const void *ptr, size_t bytes,
				  struct nc_tensor *out);

struct nc_job_result {
	int status;            /* NC_OK or a negative NC_E* code */
	uint32_t clamped_cols; /* memory-efficient backward: gamma entries clamped */
	uint64_t device_us;    /* compute time in the daemon */
	uint64_t queue_us;     /* wait in the daemon before compute */
	char variant[64];      /* the kernel variant that ran */
	char message[256];     /* the daemon's explanation when status != NC_OK */
};

/*
 * Sends a job without waiting; *request_id identifies it for nc_job_wait().
 * Any number of jobs may be in flight (up to the daemon's limit, past which
 * the job's result is NC_ERESOURCE_EXHAUSTED). Errors: NC_EINVALID_ARGUMENT,
 * NC_EIO, NC_ENOMEM. Any thread.
 */
NC_API int nc_job_submit(nc_conn *conn, const struct nc_job *job, uint64_t *request_id);

/*
 * Waits at most `timeout_ms` (< 0: no limit) for the reply to `request_id`
 * and fills *result. Returns the job's status (result->status), or NC_EIO /
 * NC_ETIMEOUT / NC_ENOT_FOUND (an id that was not submitted or was already
 * waited for) with result->status set the same. After NC_ETIMEOUT the job
 * may still complete; wait for it again. Any thread; each id is waited for once.
 */
NC_API int nc_job_wait(nc_conn *conn, uint64_t request_id, int timeout_ms,
		       struct nc_job_result *result);

/* nc_job_submit() then nc_job_wait(). */
NC_API int nc_job_run(nc_conn *conn, const struct nc_job *job, int timeout_ms,
		      struct nc_job_result *result);

/*
 * The calls above and below with a job's variants (struct nc_job_ext; NULL
 * is the plain job): the same behaviour, errors and threads. A non-zero
 * `reserved` is NC_EINVALID_ARGUMENT here; the daemon checks the rest.
 */
NC_API int nc_job_submit_ext(nc_conn *conn, const struct nc_job *job,
			     const struct nc_job_ext *ext, uint64_t *request_id);
NC_API int nc_job_run_ext(nc_conn *conn, const struct nc_job *job, const struct nc_job_ext *ext,
			  int timeout_ms, struct nc_job_result *result);

/*
 * Synchronous completion mode for device memory: orders the job after the
 * work already queued on `stream` (a cudaStream_t; NULL is the legacy default
 * stream) by synchronizing it, runs the job, and returns when the daemon
 * reports it done, so work queued on `stream` afterwards sees its outputs.
 */
NC_API int nc_job_run_on_stream(nc_conn *conn, const struct nc_job *job, void *stream,
				int timeout_ms, struct nc_job_result *result);
NC_API int nc_job_run_on_stream_ext(nc_conn *conn, const struct nc_job *job,
				    const struct nc_job_ext *ext, void *stream, int timeout_ms,
				    struct nc_job_result *result);

/*
 * The IPC-event completion mode (CUDA backend): records an interprocess
 * event on `stream` that the daemon's stream waits on before the job, and,
 * once the daemon has queued the job, makes `stream` wait on the daemon's
 * event recorded after it. Returns when the job is queued, not done: neither
 * this thread nor the daemon waits for the GPU, and work queued on `stream`
 * afterwards runs after the job. The result then has no device_us and no
 * clamped_cols. Slower than the synchronous mode for small jobs (see
 * BENCHMARKS.md); it spares the caller's CPU. Any thread; up to 64 calls of
 * one connection may be in flight at once (else NC_ERESOURCE_EXHAUSTED).
 */
NC_API int nc_job_run_event(nc_conn *conn, const struct nc_job *job, void *stream,
			    int timeout_ms, struct nc_job_result *result);
NC_API int nc_job_run_event_ext(nc_conn *conn, const struct nc_job *job,
				const struct nc_job_ext *ext, void *stream, int timeout_ms,
				struct nc_job_result *result);

/* ---- the enqueue mode -------------------------------------------------------- */

/*
 * The enqueue completion mode (docs/ENQUEUE.md), the one to use from a
 * training loop: the job is ordered with `stream` on the GPU and neither
 * this thread nor the daemon waits for it. `stream` (a cudaStream_t; NULL is
 * the legacy default stream) writes a semaphore word once the work queued
 * on it so far is done and then waits, on the GPU, for the daemon's done
 * word; the daemon watches the first word, launches the job on a stream of
 * its own for this caller stream and writes done after it. Returns once the
 * request is sent: work queued on `stream` afterwards sees the job's outputs.
 *
 * On the CPU backend `stream` is any key naming an order (jobs with the same
 * key run in order); the caller's memory is ready when it calls, and
 * nc_stream_wait() waits, on the host, for the jobs of a key.
 *
 * Errors. The job is checked here first (op, shape, dtypes, which tensors,
 * their regions and bounds): such errors return at once and nothing is
 * queued. A job the daemon refuses or fails later still releases `stream`
 * (its outputs are filled with 0xff bytes, NaN in every dtype, where its
 * tensors were valid) and its error comes back, as CUDA's asynchronous
 * errors do, from a later nc_job_enqueue() (which then queues nothing;
 * the library looks for replies when a millisecond or 32 requests have
 * passed since it last looked) or from nc_conn_check() / nc_stream_wait(),
 * which always look; nc_last_error() names the
 * request. If the daemon dies or the connection drops, the library releases
 * every stream waiting on it within a second and calls return
 * NC_EDISCONNECTED. Up to 64 streams per device may be used on one
 * connection (else NC_ERESOURCE_EXHAUSTED). When the daemon holds
 * max_jobs_in_flight unfinished jobs of the connection, it reads the next
 * request only once one finishes; the call then blocks in send() if the
 * socket is full. WGRAD_ACCUM is not enqueued (NC_EUNSUPPORTED), nor is a
 * job on a stream that is capturing a CUDA graph (NC_EUNSUPPORTED: a replay
 * runs the graph's kernels, never this call, so it would skip the job). Any
 * thread; calls on one connection are serialized. Call nc_close() only
 * after the streams that enqueued have no work left (it releases them
 * regardless).
 */
NC_API int nc_job_enqueue(nc_conn *conn, const struct nc_job *job, void *stream);
/*
 * nc_job_enqueue with the job's variants: checked here as well (their
 * tensors, the FP8 and residual rules, aliasing between tensors of one
 * region, and whether the daemon runs the variants: NC_EUNSUPPORTED).
 */
NC_API int nc_job_enqueue_ext(nc_conn *conn, const struct nc_job *job,
			      const struct nc_job_ext *ext, void *stream);

/* The tensor fields of struct nc_job, in order: x, y, mean, rstd, gamma, beta, dy,
 * dx, dgamma, dbeta, main_grad. */
#define NC_JOB_TENSORS 11

/*
 * nc_job_enqueue() of a job whose tensors are CUDA device pointers, in one
 * call: ptrs[i] names the tensor of the i-th field of struct nc_job in the
 * order of NC_JOB_TENSORS (x first, main_grad last) and is resolved as
 * nc_tensor_device_range() resolves it, with the bytes the job's op, shape
 * and dtypes give that role (its memory registered on first use);
 * a NULL entry keeps the tensor `job` has there (region 0: absent). `job`
 * itself is not changed. For callers that pay per call, such as a binding
 * from an interpreter. Errors: those of nc_tensor_device(), the message
 * naming the tensor ("tensor gamma: ..."), then those of nc_job_enqueue();
 * nothing is queued when a pointer cannot be resolved. Any thread.
 */
NC_API int nc_job_enqueue_device(nc_conn *conn, const struct nc_job *job,
				 const void *const ptrs[NC_JOB_TENSORS], void *stream);

/* NC_JOB_TENSORS, then struct nc_job_ext's: residual, residual_out, ds, scale, amax. */
#define NC_JOB_ALL_TENSORS 16

/*
 * nc_job_enqueue_device() of a job with variants: ptrs[] names the tensors
 * of struct nc_job (the first NC_JOB_TENSORS entries, as
 * nc_job_enqueue_device's) and then those of struct nc_job_ext in the
 * order residual, residual_out, ds, scale, amax, each resolved with the
 * bytes the job gives its role (an FP8 y one byte an element). `ext` may be
 * NULL (the plain norm; its five entries must then be NULL). Errors as
 * nc_job_enqueue_device()'s and nc_job_enqueue_ext()'s.
 */
NC_API int nc_job_enqueue_device_ext(nc_conn *conn, const struct nc_job *job,
				     const struct nc_job_ext *ext,
				     const void *const ptrs[NC_JOB_ALL_TENSORS], void *stream);

/*
 * Waits at most `timeout_ms` (< 0: no limit) until the daemon has answered
 * every job enqueued so far on `conn` and returns the first asynchronous
 * error not yet reported (and forgets it), NC_EDISCONNECTED, NC_ETIMEOUT,
 * or NC_OK. The daemon answers an enqueued job when it launches it, that is
 * once the caller's stream has reached it (CPU backend: once it ran), so
 * call it after the streams have been synchronized, or with a timeout.
 */
NC_API int nc_conn_check(nc_conn *conn, int timeout_ms);

/*
 * Waits on the host, at most `timeout_ms` (< 0: no limit), until every job
 * enqueued on `stream` has completed (CUDA: `stream` is idle; CPU backend:
 * the key's done word has reached its last job), then returns as
 * nc_conn_check() does.
 */
NC_API int nc_stream_wait(nc_conn *conn, void *stream, int timeout_ms);

/* ---- inspection ------------------------------------------------------------ */

#define NC_STATS_OPS 8           /* per-op slots, indexed by enum nc_op (0: unknown op) */
#define NC_STATS_DEVICES 17      /* per-device entries at most */
#define NC_LATENCY_BUCKETS 32    /* latency histogram buckets */

/*
 * One op's jobs since the daemon started. The latency histogram counts jobs
 * that ran (not those refused before running), from arrival at the daemon
 * to completion: bucket i < NC_LATENCY_BUCKETS - 1 holds jobs that took
 * less than 2^i microseconds and at least 2^(i-1) (bucket 0: under 1 us);
 * the last bucket holds every slower job.
 */
struct nc_op_stats {
	uint64_t jobs_by_status[16];  /* every job answered, by wire status value */
	uint64_t bytes;               /* read and written by jobs that succeeded */
	uint64_t device_us;           /* compute time of the jobs that ran */
	uint64_t latency_us_sum;      /* summed latency of the jobs that ran */
	uint64_t latency_buckets[NC_LATENCY_BUCKETS];
};

/* One device's jobs since the daemon started. */
struct nc_device_stats {
	int32_t index;                /* CUDA ordinal; -1: host memory (CPU backend) */
	uint64_t jobs_ok, jobs_failed; /* jobs that ran there */
	uint64_t bytes;               /* read and written by jobs that succeeded */
	uint64_t busy_us;             /* summed compute time */
	bool has_variant_cache;       /* the two counts below are reported */
	uint64_t variant_cache_hits, variant_cache_misses;
};

/*
 * Why the daemon refused a connection, a frame or a request: the index of
 * nc_stats.rejections. Same values as normd.RejectReason on the wire.
 */
#define NC_REJECT_MAP(X)                                                                \
	X(BAD_FRAME, 0, "bad_frame")                                                    \
	X(FRAME_TOO_LARGE, 1, "frame_too_large")                                        \
	X(BEFORE_HELLO, 2, "before_hello")                                              \
	X(BAD_VERSION, 3, "bad_version")                                                \
	X(BAD_REQUEST, 4, "bad_request")                                                \
	X(PEER_NOT_ALLOWED, 5, "peer_not_allowed")                                      \
	X(LIMIT_CLIENTS, 6, "limit_clients")                                            \
	X(LIMIT_REGIONS, 7, "limit_regions")                                            \
	X(LIMIT_MAPPED_BYTES, 8, "limit_mapped_bytes")                                  \
	X(LIMIT_JOBS_IN_FLIGHT, 9, "limit_jobs_in_flight")                              \
	X(OUTPUT_CAP, 10, "output_cap")                                                 \
	X(BAD_REGION, 11, "bad_region")                                                 \
	X(UNKNOWN_REGION, 12, "unknown_region")                                         \
	X(BAD_JOB, 13, "bad_job")                                                       \
	X(SHUTTING_DOWN, 14, "shutting_down")                                           \
	X(OUT_OF_MEMORY, 15, "out_of_memory")                                           \
	X(HELLO_TIMEOUT, 16, "hello_timeout")                                           \
	X(FRAME_TIMEOUT, 17, "frame_timeout")                                           \
	X(LIMIT_MAPPINGS, 18, "limit_mappings")

enum nc_reject_reason {
#define NC__REJECT_ENUM(name, value, text) NC_REJECT_##name = (value),
	NC_REJECT_MAP(NC__REJECT_ENUM)
#undef NC__REJECT_ENUM
	NC_REJECT_COUNT
};

/* The snake_case name of a rejection reason ("limit_regions"), or "unknown". Any thread. */
NC_API const char *nc_reject_name(int reason);

/* The daemon's limits (its configuration), as Stats reports them. */
struct nc_limits {
	uint32_t max_clients;        /* connections at once, all clients together */
	uint32_t max_frame;          /* bytes in one frame body */
	uint32_t max_regions;        /* registered regions per connection */
	uint32_t max_jobs_in_flight; /* per connection */
	uint64_t max_mapped_bytes;   /* registered bytes per connection */
	uint64_t max_output_bytes;   /* unread reply bytes before a client is dropped */
	uint64_t max_cols;           /* widest row */
};

struct nc_stats {
	uint64_t uptime_ms;
	uint32_t clients;
	uint64_t clients_total;
	uint64_t jobs_ok;
	uint64_t jobs_failed;
	uint32_t jobs_in_flight;
	uint32_t regions;
	uint64_t mapped_bytes;
	uint64_t rss_bytes;
	uint64_t bytes_processed;
	uint64_t errors_by_status[16]; /* every reply, indexed by wire status value */
	char backend[16];
	bool has_mps;                 /* CUDA backend: `mps` is reported */
	bool mps;                     /* its contexts run under NVIDIA MPS */
	struct nc_op_stats ops[NC_STATS_OPS]; /* indexed by enum nc_op */
	uint32_t device_count;
	struct nc_device_stats devices[NC_STATS_DEVICES];
	uint64_t rejections[32];      /* refusals, indexed by enum nc_reject_reason */
	struct nc_limits limits;
	/* Added last, so that programs built against an older header keep working. */
	uint64_t heap_bytes; /* malloc'd and not freed (0: not reported): what a leak grows */
};

/* Fetches the daemon's counters. Errors: NC_EIO, NC_ETIMEOUT. */
NC_API int nc_stats_get(nc_conn *conn, int timeout_ms, struct nc_stats *out);

/*
 * Estimates the `quantile` (0 to 1) of a latency histogram in microseconds,
 * interpolating inside the bucket it falls in (as Prometheus does), so the
 * estimate is within a factor of two. Returns 0 for an empty histogram.
 */
NC_API double nc_latency_quantile_us(const uint64_t buckets[NC_LATENCY_BUCKETS],
				     double quantile);

/* One entry of the daemon's kernel-variant cache (CUDA backend). */
struct nc_variant_info {
	int device;
	enum nc_op op;
	enum nc_dtype dtype, weight_dtype;
	unsigned flags;   /* 1 memory_efficient, 2 gamma, 4 beta */
	uint64_t cols;
	char variant[48]; /* the kernel and launch shape */
	char source[12];  /* "rule", "autotune" or "file" */
	uint64_t uses;    /* jobs that ran it since the daemon started */
};

/*
 * Fetches the variant cache. On success *out (free with nc_variants_free)
 * holds *count entries; the CPU backend has none. Errors: NC_EIO, NC_ETIMEOUT.
 */
NC_API int nc_variants_get(nc_conn *conn, int timeout_ms, struct nc_variant_info **out,
			   size_t *count);
NC_API void nc_variants_free(struct nc_variant_info *list);

#ifdef __cplusplus
}
#endif

#endif /* NORMCLIENT_H */
