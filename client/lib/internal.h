/*
 * libnormclient's private interface between its files: the connection
 * (connection.c), regions (region.c), jobs (job.c), the enqueue mode
 * (enqueue.c), the daemon's counters and state (stats.c, inspect.c) and the
 * error table and per-thread messages (status.c).
 */
#ifndef NORMCLIENT_INTERNAL_H
#define NORMCLIENT_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "normclient.h"
#include "normd.pb-c.h"

#define NC__REGION_TIMEOUT_MS 30000

struct nk_cuda_vmm_chunk;

/* One VMM mapping of a region, as the connection's index finds it by address. */
struct nc__chunk_ref {
	nc_region *region;
	unsigned index;               /* into region->chunks */
	struct nc__chunk_ref *next;   /* the index's bucket chain */
};

/* A registered region: host memory mapped here, or device memory. */
struct nc_region {
	nc_conn *conn;
	uint64_t id;
	void *data;                 /* host mapping, or the device memory's start */
	size_t size;
	int device;                 /* -1: host memfd */
	unsigned long long buffer_id; /* cudaMalloc memory: the driver's allocation id */
	unsigned chunk_count;       /* VMM memory: its mappings (0: not VMM) */
	struct nk_cuda_vmm_chunk *chunks; /* VMM memory: each mapping as registered */
	struct nc__chunk_ref *chunk_refs; /* VMM memory: one per chunk, for the index */
	uint64_t checked_ns;        /* VMM memory: when every chunk was last found current */
	uint64_t handed_ns;         /* VMM memory: when a lookup last gave out a tensor in it */
	unsigned pins;              /* jobs being assembled that name it (never swept then) */
	bool stale;                 /* VMM memory: a chunk changed; never given out again */
	bool lazy;                  /* registered by nc_tensor_device(), owned by conn */
	struct nc_region *next;     /* conn's list of its regions */
	struct nc_region *id_next, *buffer_next; /* the index's bucket chains */
};

/*
 * A connection's regions by id, by cudaMalloc allocation (buffer id) and by
 * VMM mapping address: a job's tensors are found without walking every
 * region (a training process registers hundreds). Under conn->lock.
 */
struct nc__region_index {
	nc_region **by_id, **by_buffer;
	struct nc__chunk_ref **by_chunk;
	size_t buckets;               /* of each table, a power of two */
	size_t entries;               /* ids, buffer ids and chunks filed */
};

/* A reply that arrived for a request no thread has claimed yet. */
struct nc__reply {
	struct nc__reply *next;
	Normd__Envelope *env;
};

/* An open-addressing set of request ids (0 is never an id). */
struct nc__idset {
	uint64_t *slots;
	size_t cap, count;
};
int nc__idset_add(struct nc__idset *set, uint64_t id);
/* Returns whether `id` was there. */
bool nc__idset_remove(struct nc__idset *set, uint64_t id);

struct nc_conn {
	int fd;
	pthread_mutex_t send_lock;   /* one frame at a time on the socket */
	pthread_mutex_t lock;        /* everything below */
	pthread_cond_t cond;         /* a reply arrived, or the reader left */
	bool reader_active;          /* a waiting thread is reading the socket */
	int broken;                  /* 0, or why the connection is unusable */
	char broken_message[256];
	struct nc__reply *replies;   /* unclaimed, newest first */
	struct nc__idset pending;    /* submitted ids a thread will wait for */
	struct nc__idset enqueued;   /* enqueued jobs' ids whose reply has not come */
	int async_status;            /* the first enqueued job's error not yet reported */
	char async_message[256];
	uint64_t next_request_id;
	uint64_t next_region_id;
	uint8_t *in_buf;             /* only the active reader touches these */
	size_t in_len, in_cap;
	unsigned spin_misses;        /* waits in a row that spinning did not shorten */
	bool polling;                /* nc__poll_replies is reading what has arrived */
	bool drained;                /* and a recv of it left the socket empty */
	uint64_t last_look_ns;       /* nc__poll_replies's last look at the socket, */
	uint64_t last_look_id;       /* and next_request_id then */
	unsigned spin_skips;         /* waits that did not spin since the last that did */
	struct nc_server_info info;
	uint32_t norm_features;      /* HelloReply.norm_features (enum nc_norm_features) */
	struct nc_region *regions;  /* every region registered and not yet freed */
	struct nc__region_index index; /* the same regions, looked up by key */
	unsigned stale_vmm_regions; /* lazy VMM regions marked stale, not yet unregistered */
	unsigned lazy_vmm_regions;  /* lazy VMM regions (swept every VMM_RECHECK_NS while any) */
	uint64_t last_sweep_ns;     /* the last device_sweep_stale (device.c) */
	struct nc__events *events;  /* IPC events of the event mode, made on first use */
	struct nc__enqueue *enqueue; /* semaphore slots of the enqueue mode, made on first use */
};

/* CLOCK_MONOTONIC in nanoseconds. */
uint64_t nc__now_ns(void);

/* Records the calling thread's error message and returns `status`. */
int nc__fail(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Sends one envelope (with an fd to pass, or -1). Any thread. */
int nc__send(nc_conn *conn, const Normd__Envelope *env, int fd);
/* nc__send in two steps: packing (max_frame checked; the caller frees *frame), then sending. */
int nc__pack(nc_conn *conn, const Normd__Envelope *env, uint8_t **frame, size_t *len);
int nc__send_packed(nc_conn *conn, const uint8_t *frame, size_t len);

/* Sends `env` under a fresh request id that is then awaited. Any thread. */
int nc__submit(nc_conn *conn, Normd__Envelope *env, int fd, uint64_t *request_id);

/*
 * Waits for the reply to `request_id`; *out owns it (free with
 * nc__envelope_free). timeout_ms < 0: no limit.
 */
int nc__await(nc_conn *conn, uint64_t request_id, int timeout_ms, Normd__Envelope **out);

/* Sends `env` (a fresh request id is set) and waits for its reply. */
int nc__call(nc_conn *conn, Normd__Envelope *env, int fd, int timeout_ms,
	     Normd__Envelope **reply);

/* Sends `env` and waits for a Result; returns its status (message recorded). */
int nc__call_result(nc_conn *conn, Normd__Envelope *env, int fd, int timeout_ms);
/* The same with `count` fds (at most NC_VMM_MAX_CHUNKS) passed with the frame; they stay the caller's. */
int nc__call_result_fds(nc_conn *conn, Normd__Envelope *env, const int *fds, unsigned count,
			int timeout_ms);

/*
 * nc__call() for requests with a reply type of their own: any other reply
 * (`what` names the request in the message) is NC_EPROTOCOL_ERROR.
 */
int nc__call_expect(nc_conn *conn, Normd__Envelope *env, int timeout_ms,
		    Normd__Envelope__BodyCase expected, const char *what, Normd__Envelope **reply);

/* Copies a string from a reply (NULL: "") into a fixed array, truncating. */
static inline void nc__copy_string(char *dst, size_t len, const char *src)
{
	snprintf(dst, len, "%s", src ? src : "");
}

/*
 * nc_job_submit with the IPC-event mode's wait_event (64 bytes; NULL: none)
 * and early_reply (answer once queued, naming a done event).
 */
int nc__job_submit_event(nc_conn *conn, const struct nc_job *job, const struct nc_job_ext *ext,
			 const uint8_t *wait_event, bool early_reply, uint64_t *request_id);
/* nc_job_wait that also copies the reply's done_event (all zero if none). */
int nc__job_wait_event(nc_conn *conn, uint64_t request_id, int timeout_ms,
		       struct nc_job_result *result, uint8_t *done_event);

/* Adds a registered region to its connection's list and index (lock taken inside). */
void nc__region_track(nc_region *region);
/* Takes a listed region out of the index (conn->lock held; the caller unlinks it). */
void nc__region_unindex(nc_region *region);
/* Sends UnregisterRegion for it; returns the daemon's status. */
int nc__region_unregister(nc_region *region);
/* Unmaps host memory and frees the region (no message). */
void nc__region_release(nc_region *region);
/* Unmaps and frees every region still listed (at nc_close; no messages). */
void nc__regions_release_all(nc_conn *conn);
/* The index's first buckets; NC_ENOMEM (at nc_connect). */
int nc__region_index_init(struct nc__region_index *index);
void nc__region_index_free(struct nc__region_index *index);
/* The region with this id (conn->lock held), or NULL. */
nc_region *nc__region_find(nc_conn *conn, uint64_t id);
/* The chains holding regions of this buffer id / chunks mapped at this address: filter by key. */
nc_region *nc__region_buffer_chain(nc_conn *conn, unsigned long long buffer_id);
struct nc__chunk_ref *nc__region_chunk_chain(nc_conn *conn, uint64_t base);
/* Destroys the connection's IPC events (at nc_close). */
void nc__events_release(nc_conn *conn);

/* Tensor messages a Job can carry: one per role of proto/job_roles.h. */
#define NC__JOB_TENSORS 16
/*
 * Fills a Job message from `job` and `ext` (NULL: none; tensors live in
 * `ts`, NC__JOB_TENSORS of them, on the caller's stack).
 */
void nc__job_to_msg(const struct nc_job *job, const struct nc_job_ext *ext, Normd__Job *msg,
		    Normd__Tensor *ts);
/* NC_EINVALID_ARGUMENT (message recorded) when ext's reserved words are not zero. */
int nc__job_ext_check(const struct nc_job_ext *ext);

/*
 * The bytes a job's tensor of `role` (proto/job_roles.h) spans, from the op,
 * shape and dtypes (ext may be NULL); 0 if that overflows.
 */
uint64_t nc__role_bytes(const struct nc_job *job, const struct nc_job_ext *ext, int role);

/* The enqueue mode (enqueue.c). With conn->lock held: an enqueued job's reply arrived. */
void nc__enqueue_answered(nc_conn *conn, const Normd__Envelope *env);
/* NC_EUNSUPPORTED (with its message) if the CUDA stream is capturing a graph, else 0. */
int nc__refuse_capture(void *stream);
/* nc_job_enqueue_ext; capture_checked: the caller asked nc__refuse_capture already. */
int nc__job_enqueue(nc_conn *conn, const struct nc_job *job, const struct nc_job_ext *ext,
		    void *stream, bool capture_checked);
/*
 * Reads whatever replies have arrived, without waiting, if the last look
 * was a millisecond or 32 requests ago (connection.c): each look is a recv,
 * and an enqueued job's reply matters only when it carries an error.
 */
void nc__poll_replies(nc_conn *conn);
/* Waits until every enqueued job has been answered; 0 or NC_ETIMEOUT. */
int nc__await_enqueued(nc_conn *conn, int timeout_ms);
/* nc_close: stops the watcher thread (before the socket closes). */
void nc__enqueue_stop(nc_conn *conn);
/* nc_close: releases every caller stream and frees the semaphore slots. */
void nc__enqueue_release(nc_conn *conn);

#endif /* NORMCLIENT_INTERNAL_H */
