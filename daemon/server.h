/*
 * normd's core state: the server, its clients, their regions and jobs, and
 * the backend interface. One libuv loop thread owns all of it; backend
 * worker threads only touch the jobs handed to them and give them back
 * through job_post_completion().
 *
 * Where things live:
 *   server.c      listener, signals, drain, client list, stats
 *   client.c      one connection: socket I/O, frames, output queue, lifetime
 *   dispatch.c    what each request does
 *   reply.c       every message the daemon sends
 *   region.c      a connection's registered memory
 *   job.c         job validation, submission and completion
 *   estream.c     the enqueue mode: jobs ordered with a caller's stream
 *   backend_*.c   where jobs run (backend_cpu.c: host memory, threads)
 *   stats.c       per-op and per-device counters, latency histograms
 *   notify.c      systemd notifications (READY, STATUS, STOPPING, WATCHDOG)
 *   config.c      the settings table; log.c logging
 */
#ifndef NORMD_SERVER_H
#define NORMD_SERVER_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include <uv.h>

#include "daemon/config.h"
#include "kernels/norm_kernels.h"
#include "kernels/wgrad.h"
#include "normclient.h"
#include "normd.pb-c.h"

/* fds received but not yet claimed by a frame: one more than a VMM region's chunks, so that
 * a frame with too many is seen as such rather than cut to size. */
#define CLIENT_MAX_PENDING_FDS (NC_VMM_MAX_CHUNKS + 1)
#define JOB_MAX_TENSORS 16 /* the roles of proto/job_roles.h */
#define JOB_MAX_OUTPUTS 5  /* a forward with y, residual_out, mean, rstd and amax */

struct backend;
struct client;
struct estream;
struct job;

/* ---- regions (region.c) ---------------------------------------------------- */

struct region {
	uint64_t id;            /* the client's name for it, unique per connection */
	Normd__RegionKind kind;
	void *base;             /* where the daemon reaches it (host or device address) */
	uint64_t size;          /* bytes the client may name */
	size_t mapped_size;     /* bytes this region accounts for */
	int device;             /* CUDA device ordinal; -1: host memory */
	unsigned refs;          /* 1 while registered + 1 per job using it */
	uint8_t handle[64];     /* CUDA_IPC: the handle bytes it was opened from */
	void *mapping;          /* backend-owned state: an opened IPC handle (shared by regions of
				   one handle) or a VMM region's imported chunks */
	uint64_t file_dev, file_ino; /* HOST_MEMFD: the memfd's identity, so that the alias
				    check sees two registrations of one memfd as one memory */
	void (*release)(struct region *region); /* backend unmapping; NULL for a memfd that
						   no backend registered */
};

/* Open-addressing table of one connection's regions, keyed by id. */
struct region_table {
	struct region **slots;
	size_t capacity; /* power of two, or 0 */
	size_t count;
	uint64_t mapped_bytes;
};

void region_table_init(struct region_table *table);
/* Drops the table's reference on every region; regions in use by jobs live on. */
void region_table_clear(struct region_table *table);
struct region *region_lookup(const struct region_table *table, uint64_t id);
/* Unmaps a host memfd region (what region_unref does for one without a release hook). */
void region_unmap_memfd(struct region *region);
/* Maps a host memfd region; takes ownership of `fd` in every case. */
int region_map_memfd(int fd, uint64_t id, uint64_t size, struct region **out, char *why,
		     size_t why_len);
/*
 * Checks a RegisterRegion's chunk_sizes against its kind and the fds its frame
 * carried (`fd_count`): CUDA_VMM_FD needs 1 to NC_VMM_MAX_CHUNKS chunks, each
 * of a non-zero size, as many fds, and sizes that add up to `size`; no other
 * kind takes chunk_sizes. Returns 0 or NC_EINVALID_ARGUMENT with a reason.
 */
int region_check_chunks(const Normd__RegisterRegion *msg, unsigned fd_count, char *why,
			size_t why_len);
/* A CUDA_IPC region of the table opened from these handle bytes on `device`. */
struct region *region_find_handle(const struct region_table *table, const uint8_t handle[64],
				  int device);
/* A zeroed region with one reference, counted as live; NULL when out of memory. */
struct region *region_new(uint64_t id, Normd__RegionKind kind, uint64_t size, int device);
int region_insert(struct region_table *table, struct region *region);
struct region *region_remove(struct region_table *table, uint64_t id);
void region_ref(struct region *region);
void region_unref(struct region *region);
/* Live regions and their mapped bytes across all connections. */
uint64_t region_live_count(void);
uint64_t region_live_bytes(void);

/*
 * The daemon-wide cap on mappings of client memory (docs/SECURITY.md): a
 * memfd region is one mapping, an opened CUDA IPC handle one however many
 * regions share it. Without a configured cap: vm.max_map_count, less the
 * mappings the process has once its backend is up, less a margin for what
 * it maps later (malloc arenas and large blocks, thread stacks, libuv, CUDA).
 */
#define REGION_DEFAULT_MAP_COUNT 65530 /* the kernel's default vm.max_map_count */
#define REGION_MAPPING_MARGIN 8192
/* Sets the cap (`configured`, or 0: derived as above), logs and returns it. Start-up only. */
uint64_t region_mappings_init(uint64_t configured);
/* Takes one mapping under the cap; false at the cap. Any thread. */
bool region_mapping_reserve(void);
/* Gives one back: it was unmapped, or never made. Any thread. */
void region_mapping_release(void);
/* The same for `n` mappings at once (a VMM region holds one per chunk); all or none. */
bool region_mapping_reserve_n(unsigned n);
void region_mapping_release_n(unsigned n);
uint64_t region_mappings_live(void);
uint64_t region_mappings_cap(void);

/* ---- clients (client.c) ---------------------------------------------------- */

/*
 * A block of the output queue: replies the socket did not take, appended
 * one after another (one allocation for many small replies).
 */
struct out_chunk {
	struct out_chunk *next;
	size_t len, sent, cap;       /* bytes held, bytes written, room */
	uint8_t bytes[];
};

/* What a block costs against max_output_bytes: its allocation plus malloc's own overhead. */
#define OUT_CHUNK_COST(cap) (sizeof(struct out_chunk) + (cap) + 16)

/* An fd received with SCM_RIGHTS, waiting for the frame it arrived with to be dispatched. */
struct pending_fd {
	int fd;
	uint64_t frame;              /* stream offset of that frame's first byte */
};

struct client {
	struct server *srv;
	struct client *prev, *next;  /* server's list */
	uint64_t id;                 /* for logs */
	int fd;
	uv_poll_t poll;
	int poll_events;             /* UV_READABLE / UV_WRITABLE currently watched */
	pid_t pid;                   /* SO_PEERCRED at accept */
	uid_t uid;
	gid_t gid;
	char name[64];               /* from Hello */
	uint32_t protocol_version;   /* from Hello (1 to PROTOCOL_VERSION) */
	bool hello_done;             /* Hello accepted; other requests allowed */
	bool closing;                /* no more input; freed when jobs and handle are done */
	bool close_after_flush;      /* protocol violation: send what is queued, then close */
	bool poll_closed;            /* uv_close on the poll handle has completed */
	uint8_t *in_buf;             /* partial frame bytes */
	size_t in_len, in_cap;
	uint64_t accepted_ns;        /* when it connected: Hello is due hello_timeout_ms later */
	uint64_t frame_start_ns;     /* when the frame in_buf holds part of began (0: none) */
	uint64_t in_base;            /* stream offset of in_buf[0] (always a frame's start) */
	struct pending_fd pending_fds[CLIENT_MAX_PENDING_FDS]; /* SCM_RIGHTS fds, oldest first */
	unsigned pending_fd_count;
	uint64_t dispatch_frame;     /* stream offset of the frame being dispatched, or UINT64_MAX */
	struct out_chunk *out_head, *out_tail;
	size_t out_bytes;            /* memory the output queue holds (OUT_CHUNK_COST of each block) */
	bool output_paused;          /* backpressure: queue past max_output_bytes / 2, not reading */
	bool flush_pending;          /* the queue holds replies not tried yet: written before the next poll */
	bool flush_listed;           /* on the server's flush list */
	struct client *flush_next;   /* that list */
	struct region_table regions;
	unsigned jobs_in_flight;
	bool mapping;                /* a registration is being mapped off the loop: input waits */
	struct estream *estreams;    /* its enqueue streams (estream.c) */
	unsigned estream_count;
};

/* Whether the client's input waits (a registration maps, or enqueued jobs are at the limit). */
bool client_input_paused(const struct client *c);

/* Accepts a connected socket; the client owns `fd` from here. */
int client_create(struct server *srv, int fd, pid_t pid, uid_t uid, gid_t gid);
/* Stops reading and releases everything except what in-flight jobs hold. */
void client_close(struct client *c, const char *reason);
/* Queues one frame (takes ownership of `bytes`). Drops the client past its cap. */
void client_send(struct client *c, uint8_t *bytes, size_t len);
/*
 * Room for a small frame of `len` bytes at the end of the output queue,
 * written with the connection's other replies before the loop next polls
 * (client_flush_pending); NULL when the frame must go through client_send
 * (the socket is backed up, the frame is large, or the caps say no).
 */
uint8_t *client_defer_room(struct client *c, size_t len);
/* Writes every connection's deferred replies, one send per connection. Loop thread, before polling. */
void client_flush_pending(struct server *srv);
/*
 * Hands over the fds that arrived with the frame being dispatched, in the
 * order they were sent, at most `max` of them into fds[]; returns how many
 * the frame brought (more than `max`: the rest stay unclaimed). fds never
 * wait for a later frame: those of a frame that does not claim them are
 * closed once it has been dispatched.
 */
unsigned client_claim_fds(struct client *c, int *fds, unsigned max);
/* Frees a closing client once its jobs and handle are done; true if freed. */
bool client_try_free(struct client *c);
/* Whatever paused input (a mapping, jobs in flight, unread output) is clear: reads input again. */
void client_resume(struct client *c);
/*
 * Closes the client if Hello is overdue (hello_timeout_ms) or a started
 * frame is (frame_timeout_ms); the server's sweep calls it every so often.
 */
void client_check_deadlines(struct client *c, uint64_t now_ns);

/* ---- replies (reply.c) ----------------------------------------------------- */

void reply_result(struct client *c, uint64_t request_id, int status, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
void reply_hello(struct client *c, uint64_t request_id);
void reply_job(struct client *c, const struct job *job);
void reply_stats(struct client *c, uint64_t request_id);
void reply_pong(struct client *c, uint64_t request_id, uint64_t nonce);
void reply_go_away(struct client *c, int status, const char *message);
void reply_variants(struct client *c, uint64_t request_id);

/* ---- requests (dispatch.c) --------------------------------------------------- */

/* Handles one decoded envelope from `c`; the caller frees `env` after. */
void dispatch_envelope(struct client *c, const Normd__Envelope *env);

/* ---- jobs (job.c) ------------------------------------------------------------ */

struct job {
	struct job *next;            /* backend queue / completion queue link */
	struct client *client;       /* counted in client->jobs_in_flight */
	uint64_t request_id;
	Normd__Op op;
	int device;                  /* where its regions live (-1: host) */
	bool wgrad;                  /* WGRAD_ACCUM: `gemm` holds it, not `args` */
	bool has_wait_event;         /* the stream waits on wait_event first */
	bool early_reply;            /* reply when enqueued (done_event), not when done */
	bool notice;                 /* only the early reply of a job still running */
	bool replied;                /* its early reply went out already */
	uint8_t wait_event[64];      /* the client's cudaIpcEventHandle_t */
	uint8_t done_event[64];      /* the daemon's, recorded after the job */
	struct nk_norm_args args;    /* pointers resolved into the regions below */
	struct nk_wgrad_args gemm;
	void *main_grad;             /* WGRAD_ACCUM's output, resolved */
	struct region *regions[JOB_MAX_TENSORS]; /* one reference each */
	unsigned region_count;
	uint64_t bytes;              /* bytes the job reads and writes */
	uint64_t deadline_us;
	uint64_t t_arrive_ns, t_start_ns, t_end_ns;
	int status;                  /* NC_OK or NC_E*, set by the backend */
	char message[256];
	char variant[64];
	uint32_t clamped_cols;
	struct estream *estream;     /* the enqueue mode: the caller stream it is ordered with */
	struct job *es_next;         /* the estream's list, in seq order */
	uint32_t seq;                /* its sequence number there */
	bool bound;                  /* its tensors point into its regions (bounds checked) */
	bool launched;               /* enqueue mode: queued on the device, answered */
};

/*
 * A job's outputs as byte ranges, for poisoning a failed enqueued job
 * (0xff bytes are NaN in f32, f16, bf16 and both FP8 formats).
 * Returns how many (at most JOB_MAX_OUTPUTS), in the order y, residual_out,
 * amax, rstd, mean.
 */
struct job_output {
	void *ptr;
	uint64_t bytes;
};
unsigned job_outputs(const struct job *job, struct job_output out[JOB_MAX_OUTPUTS]);

/*
 * Checks everything a client controls in `msg` against `regions` and `cfg`
 * and touches nothing else (tests/fuzz/fuzz_frame.c calls it directly). On
 * success job->args (or job->gemm) points into the regions and job->regions
 * holds one reference per tensor; on failure job->status and job->message
 * say why, and references already taken stay in job->regions. Returns
 * job->status.
 */
int job_validate(struct job *job, const struct region_table *regions, const struct config *cfg,
		 const Normd__Job *msg);
/* Drops the job's region references and frees it. */
void job_release(struct job *job);
/* Validates `msg` against c's regions and submits it; always answers. */
void job_submit(struct client *c, uint64_t request_id, const Normd__Job *msg);
/* Called by backends from any thread when a job has run (or failed). */
void job_post_completion(struct job *job);
/* The loop's uv_async callback: answers every completed job. */
void job_drain_completions(uv_async_t *async);

/* ---- the enqueue mode (estream.c, docs/ENQUEUE.md) ------------------------------- */

#define ESTREAM_SLOT_BYTES 128 /* a semaphore slot: ready at +0, by default done at +64 */
#define ESTREAM_DONE_OFFSET 64  /* also the done word's alignment */

/* A caller stream's semaphore slot on one connection, and its jobs. */
struct estream {
	struct estream *next;        /* the client's list */
	struct estream *busy_prev, *busy_next; /* server's list of streams with jobs queued */
	bool busy;                   /* on that list */
	struct client *client;
	uint64_t region_id, offset;  /* the slot, as the client names it */
	struct region *sem;          /* the ready word's region: one reference while it lives */
	struct region *done_region;  /* the done word's (often the same): one reference */
	void *ready, *done;          /* the slot's words where the daemon reaches them */
	int device;                  /* whose streams it orders: the done word's or the one
					named with a done word in host memory (-1: CPU backend) */
	uint32_t last_seq;           /* newest seq accepted */
	bool abandoned;              /* the client left: run or fail what is queued, then close */
	struct job *head, *tail;     /* accepted, not finished, in seq order */
	struct job *running;         /* loop-ordered backends: the job the backend has */
	void *backend_state;         /* the backend's (cuda: its stream, workspace, words) */
};

/* True when `a` comes at or after `b` in 32-bit cyclic order. */
static inline bool seq_reached(uint32_t a, uint32_t b)
{
	return (int32_t)(a - b) >= 0;
}

/*
 * The enqueue stream a Job's Enqueue names, created on first use; checks the
 * slot's words (regions of this connection, alignment, bounds; the backend
 * checks where they live) and the seq.
 * Returns 0 or NC_E* with a reason in `why`.
 */
int estream_for_job(struct client *c, const Normd__Enqueue *msg, struct estream **out, char *why,
		    size_t why_len);
/* Takes an enqueued job (validated or refused) in seq order; it counts as in flight. */
void estream_push(struct estream *es, struct job *job);
/* The backend launched or finished an estream job (loop thread, from job_finish). */
void estream_job_done(struct job *job);
/* Finishes jobs whose completion the device reported; pumps waiting streams. Loop thread. */
void estream_poll(struct server *srv);
/*
 * Whether the loop's per-iteration drain should call estream_poll() now:
 * always for loop-ordered streams, at most every ESTREAM_REAP_NS for
 * device-ordered ones (the estream timer still polls every millisecond).
 */
bool estream_poll_due(struct server *srv);
/* The client is closing: release the daemon's waits on its streams. */
void estream_abandon_all(struct client *c);
/* Poisons a failed job's outputs in host memory (loop or worker thread). */
void estream_poison_host(const struct job *job);

/* ---- backends ---------------------------------------------------------------- */

/* One entry of a device's kernel-variant cache, as `normctl variants` lists it. */
struct variant_row {
	int device;
	enum nk_op op;
	enum nk_dtype dtype, weight_dtype;
	unsigned flags;              /* enum variant_key_flags (variant_cache.h) */
	int64_t cols;
	char variant[48];            /* nk_variant_name() */
	char source[12];             /* "rule", "autotune" or "file" */
	uint64_t uses;
};

/* One device as HelloReply reports it. */
struct backend_device {
	int index;                   /* CUDA ordinal; -1 for the host */
	uint8_t uuid[16];
	char name[128];
	uint32_t sm_count;
	uint64_t total_memory;
};

struct backend {
	const char *name;            /* "cpu" or "cuda" */
	Normd__BackendKind kind;
	const struct backend_device *devices;
	int device_count;
	bool poll_completions;       /* the loop polls for completions while jobs run */
	/*
	 * Maps the memory a RegisterRegion names (limits, ids and chunk_sizes
	 * are already checked). Takes ownership of the `fd_count` fds its frame
	 * brought (HOST_MEMFD: at most one; CUDA_VMM_FD: one per chunk) and
	 * closes them in every case. `twin` is a region of
	 * the same connection opened from the same CUDA IPC handle on the same
	 * device, whose mapping the new region shares, or NULL. Without a twin
	 * it runs on libuv's thread pool (opening an IPC handle takes hundreds
	 * of microseconds the loop must not stall for) and may touch nothing but
	 * what it creates; with one, on the loop thread. Returns 0 or NC_E*
	 * with a reason in `why`.
	 */
	int (*region_map)(struct backend *backend, struct region *twin,
			  const Normd__RegisterRegion *msg, const int *fds, unsigned fd_count,
			  struct region **out, char *why, size_t why_len);
	/* Queues the job; the backend later calls job_post_completion(). */
	int (*submit)(struct backend *backend, struct job *job);
	/* NULL while healthy; once a device is lost, why (then the daemon exits). */
	const char *(*fatal_error)(struct backend *backend);
	/* The variant cache as rows (nc__malloc'ed, count in *n); may be NULL. */
	struct variant_row *(*variants)(struct backend *backend, size_t *n);
	/* Variant-cache hits and misses on `device` so far, for Stats; may be NULL. */
	void (*variant_cache_counts)(struct backend *backend, int device, uint64_t *hits,
				     uint64_t *misses);
	/* Stops the workers after the queued jobs are done, and frees. */
	void (*destroy)(struct backend *backend);
	/*
	 * The enqueue mode. With orders_streams, submit() takes every job of an
	 * estream at once (refused ones too: it poisons their outputs and writes
	 * their done word in order) and the device orders them after the slot's
	 * ready word; the backend posts each job once launched and reports
	 * completions through stream_retired(). Without, the loop hands over
	 * one job of a stream at a time, once its ready word is seen, and writes
	 * done itself when the job comes back.
	 */
	bool orders_streams;
	bool mps;                    /* the device contexts run under NVIDIA MPS */
	/*
	 * The norm variants it runs (enum nk_features; HelloReply.norm_features):
	 * a job using another is refused with UNSUPPORTED before it is queued.
	 * 0 (the default of a zeroed backend) runs the plain norms only.
	 */
	unsigned norm_features;
	/* Creates the backend's state of a new stream (loop thread); NULL: nothing to do. */
	int (*stream_open)(struct backend *backend, struct estream *es, char *why, size_t why_len);
	/* The latest seq whose job the device has finished on `es`. */
	uint32_t (*stream_retired)(struct backend *backend, struct estream *es);
	/* The client left: make the device stop waiting for its ready words. */
	void (*stream_abandon)(struct backend *backend, struct estream *es);
	/* No job is left on `es`: free the backend's state. */
	void (*stream_close)(struct backend *backend, struct estream *es);
};

int backend_cpu_create(const struct config *cfg, struct backend **out);
/* Opens the CUDA devices `cfg->device` names ("0", "0,1", "all"). */
int backend_cuda_create(const struct config *cfg, struct backend **out);

/* ---- systemd notifications (notify.c) ------------------------------------------ */

/*
 * Reads $NOTIFY_SOCKET and, when a service manager listens there, sends
 * READY=1 with a first STATUS= line and starts the STATUS= and WATCHDOG=1
 * timers. Call once the socket is bound and the backend initialised, right
 * before uv_run(). Without $NOTIFY_SOCKET only the (idle) timers are set up.
 * Returns 0, or -1 if the timers could not be initialised.
 */
int notify_start(struct server *srv);
/* True when notifications go to a service manager. */
bool notify_enabled(void);
/* Sends one message ("KEY=value" lines); a no-op when not supervised. */
void notify_send(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* STOPPING=1 and a draining STATUS=, when the drain begins. */
void notify_stopping(struct server *srv);
/* Closes the timers (part of the shutdown); safe to call twice. */
void notify_stop(struct server *srv);
/* Closes the notification socket after the loop has ended. */
void notify_close(void);

/* ---- the server (server.c) --------------------------------------------------- */

#define STATS_OPS (NORMD__OP__WGRAD_ACCUM + 1) /* slots by wire Op; 0: unknown ops */
#define STATS_LATENCY_BUCKETS 32  /* log2 microsecond buckets (normd.proto, OpStats) */
#define STATS_DEVICES 17          /* slot 0: host memory; slot 1 + i: GPU i */

/* One op's jobs (stats.c). */
struct op_stats {
	uint64_t jobs_by_status[NORMD__STATUS__INTERNAL + 1]; /* every job answered */
	uint64_t bytes;              /* moved by jobs that succeeded */
	uint64_t device_us;          /* compute time of jobs that ran */
	uint64_t latency_us_sum;     /* arrival to completion of jobs that ran */
	uint64_t latency[STATS_LATENCY_BUCKETS];
};

/* One device's jobs (stats.c); variant-cache counts come from the backend. */
struct device_stats {
	uint64_t jobs_ok, jobs_failed; /* jobs that ran there */
	uint64_t bytes;              /* moved by jobs that succeeded */
	uint64_t busy_us;            /* summed compute time */
};

/* Counters reported by Stats. */
struct server_stats {
	uint64_t clients_total;
	uint64_t jobs_ok;
	uint64_t jobs_failed;
	uint64_t bytes_processed;
	uint64_t errors_by_status[NORMD__STATUS__INTERNAL + 1];
	struct op_stats ops[STATS_OPS];
	struct device_stats devices[STATS_DEVICES];
	uint64_t rejections[NC_REJECT_COUNT]; /* refusals by reason (enum nc_reject_reason) */
};

/* ---- statistics (stats.c) ----------------------------------------------------- */

/*
 * Counts one answered job: by op and status, and, when it reached the
 * backend (`ran`), its latency, compute time and device. Loop thread.
 */
void stats_count_job(struct server *srv, const struct job *job, bool ran);
/*
 * Adds the per-op and per-device counters to `reply`. The sub-messages live
 * in static storage that the next call reuses: pack the reply before that.
 */
void stats_fill_reply(struct server *srv, Normd__StatsReply *reply);
/* The histogram bucket of a latency in microseconds. */
unsigned stats_latency_bucket(uint64_t us);
/* Counts a reply status in the stats. */
void stats_count_status(struct server *srv, int status);
/* Counts one refused connection, frame or request under its reason. */
void stats_count_rejection(struct server *srv, enum nc_reject_reason reason);
/* CLOCK_MONOTONIC in nanoseconds: job arrival, start and end times. Any thread. */
uint64_t stats_now_ns(void);

struct server {
	uv_loop_t *loop;
	const struct config *cfg;
	struct backend *backend;
	int listen_fd;
	bool listen_fd_inherited;    /* from systemd: do not unlink the path */
	uv_poll_t listen_poll;
	uv_signal_t sig_term, sig_int;
	uv_prepare_t reaper;         /* before each poll: writes deferred replies, frees closing clients */
	uv_async_t completion_async; /* workers -> loop: completed jobs */
	uv_idle_t completion_poll;   /* polls the completion queue while jobs run */
	atomic_bool loop_polling;    /* completion_poll is on: workers need not wake the loop */
	uint64_t last_job_ns;        /* when the latest job was handed to the backend */
	uv_timer_t estream_timer;    /* polls enqueue streams while any has jobs (estream.c) */
	struct estream *busy_estreams; /* streams with jobs queued */
	uint64_t estream_reaped_ns;  /* when the drain last reaped device-ordered streams */
	_Atomic(struct job *) completed; /* finished jobs, newest first (a lock-free stack) */
	struct client *flush_list;   /* clients with deferred replies (client_defer_room) */
	uv_timer_t drain_timer;
	uv_timer_t deadline_timer;   /* sweeps clients for overdue Hellos and frames */
	size_t freed_since_trim;     /* client buffer bytes freed since the last malloc_trim */
	size_t out_bytes_total;      /* every connection's out_bytes together */
	uv_timer_t notify_status_timer;   /* STATUS= for systemd every few seconds (notify.c) */
	uv_timer_t notify_watchdog_timer; /* WATCHDOG=1 when the unit sets WatchdogSec= */
	bool notify_timers_ready;    /* the two timers above are initialised */
	struct client *clients;      /* all connections, closing ones included */
	unsigned client_count;       /* open (not closing) connections */
	unsigned jobs_in_flight;     /* across all clients */
	uint64_t next_client_id;
	uint64_t start_ns;
	bool draining;               /* SIGTERM seen: no new work */
	bool stopped;                /* every handle is closing; uv_run is ending */
	int exit_code;
	uint32_t allowed_uids[CONFIG_MAX_IDS], allowed_gids[CONFIG_MAX_IDS];
	int allowed_uid_count, allowed_gid_count; /* -1/0: no restriction */
	struct server_stats stats;
};

/* The one server of this process (the loop thread's). */
extern struct server *server_instance;

int server_run(const struct config *cfg, struct backend *backend);
/*
 * A job was handed to the backend at `now_ns` (0: now; a job's arrival time
 * when it is handed over as it arrives, which saves reading the clock):
 * poll for completions if the backend wants.
 */
void server_job_started(struct server *srv, uint64_t now_ns);
/*
 * Test hook, set by main() from NORMD_TEST_FAIL_ALLOC: once the server is
 * listening, allocation number N (through nc__malloc and friends) fails,
 * once. 0, the default, injects nothing.
 */
extern uint64_t server_test_fail_alloc;
/* A device is lost: GoAway(DEVICE_ERROR) to all, drain, exit non-zero. */
void server_fail(struct server *srv, const char *why);
/* Re-checks whether a drain has finished. */
void server_drain_check(struct server *srv);

#endif /* NORMD_SERVER_H */
