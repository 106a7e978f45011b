/*
 * The few CUDA driver API entry points normd needs, reached through
 * cudaGetDriverEntryPointByVersion so that nothing links libcuda: the daemon
 * and the client library start on a machine without a GPU and say so.
 * Shared by the daemon and libnormclient.
 */
#ifndef NORMD_CUDA_DRIVER_H
#define NORMD_CUDA_DRIVER_H

#include <stdbool.h>
#include <pthread.h>
#include <stdint.h>

/* What the driver knows about the allocation holding a device pointer. */
struct nk_cuda_pointer_info {
	uint64_t base;               /* start of the allocation */
	uint64_t size;               /* its size in bytes */
	unsigned long long buffer_id; /* process-wide unique, never reused */
	int device;                  /* device ordinal */
	bool managed;                /* cudaMallocManaged */
	bool from_pool;              /* cudaMallocAsync / memory pools */
	bool ipc_capable;            /* cudaIpcGetMemHandle works on it */
};

/*
 * Fills *out for `ptr`. Returns 0, or -1 with a static reason in *why (no
 * driver, not a device pointer, ...).
 */
int nk_cuda_pointer_info(const void *ptr, struct nk_cuda_pointer_info *out, const char **why);

/*
 * The buffer id alone of the allocation holding `ptr`: one attribute where
 * nk_cuda_pointer_info asks for eight. Returns 0, or -1 when the driver is
 * missing or does not know the pointer.
 */
int nk_cuda_pointer_buffer_id(const void *ptr, unsigned long long *buffer_id);

/* The size of the allocation that starts at `base` (as opened by IPC); -1 on failure. */
int nk_cuda_allocation_size(const void *base, uint64_t *size, const char **why);

/*
 * Stream memory operations of the enqueue mode (docs/ENQUEUE.md), on 32-bit
 * words in device memory or in pinned host memory. `stream` is a
 * cudaStream_t. Waits compare cyclically: (int32_t)(*word - value) >= 0.
 * Writes are preceded by a fence, so the stream's earlier writes are visible
 * first. Each returns 0, or -1 (the driver lacks the call, or refused it).
 */
/* The stream writes `value` to `word`, then waits for *wait_word >= wait_value. One call. */
int nk_cuda_stream_signal_wait(void *stream, void *word, uint32_t value, void *wait_word,
			       uint32_t wait_value);
/* The stream waits until *word >= value. */
int nk_cuda_stream_wait(void *stream, void *word, uint32_t value);
/* The stream writes `value` to `word_a` and, unless NULL, to `word_b`. One call. */
int nk_cuda_stream_write(void *stream, void *word_a, void *word_b, uint32_t value);
/* Whether contexts on `device` run under NVIDIA MPS; -1 when the driver cannot say. */
int nk_cuda_mps_enabled(int device);

/*
 * CUDA IPC events opened from their 64-byte handles, each once, kept up to
 * `capacity`. Used by the daemon for clients' wait events and by the library
 * for the daemon's done events. Thread-safe: an event handed out by
 * nk_ipc_event_open() stays valid until its nk_ipc_event_release(); a full
 * cache evicts, round robin, only entries nobody holds (when every entry is
 * held, the event is opened uncached and destroyed on release).
 */
struct nk_ipc_event_cache {
	pthread_mutex_t lock;
	unsigned capacity, count, next;
	struct nk_ipc_event_entry {
		uint8_t handle[64];
		void *event;    /* cudaEvent_t */
		unsigned users; /* opened and not yet released */
	} *entries;
};

int nk_ipc_event_cache_init(struct nk_ipc_event_cache *cache, unsigned capacity);
void nk_ipc_event_cache_destroy(struct nk_ipc_event_cache *cache);
/* The event (a cudaEvent_t) for these handle bytes, opened on first use; NULL on failure. */
void *nk_ipc_event_open(struct nk_ipc_event_cache *cache, const uint8_t handle[64]);
/* Done with an event nk_ipc_event_open() returned (NULL: nothing to do). */
void nk_ipc_event_release(struct nk_ipc_event_cache *cache, void *event);

#endif /* NORMD_CUDA_DRIVER_H */
