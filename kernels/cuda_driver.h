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
	bool vmm_fd_capable;         /* cuMemCreate memory exportable as a POSIX fd */
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
 * VMM memory (cuMemCreate allocations mapped with cuMemMap, docs/SECURITY.md).
 * A chunk is one mapping: one physical allocation mapped at `base`.
 */
struct nk_cuda_vmm_chunk {
	uint64_t base;                /* where it is mapped in this process */
	uint64_t size;                /* the mapping's size in bytes */
	unsigned long long block_id;  /* the driver's id of the physical allocation,
					 unique for the process's life */
};

/*
 * The consecutive mappings that cover [ptr, ptr + bytes) (bytes >= 1), each
 * on `device` and exportable as a POSIX fd, into out[0..max). Returns their
 * count, max + 1 when more than max would be needed (out then holds the
 * first max), or -1 with a static reason in *why (no driver, an address
 * that is not mapped, a chunk not exportable as an fd or on another device).
 */
int nk_cuda_vmm_chunks(const void *ptr, uint64_t bytes, int device, struct nk_cuda_vmm_chunk *out,
		       unsigned max, const char **why);

/*
 * A POSIX fd for the allocation mapped at `base` (cuMemRetainAllocationHandle,
 * cuMemExportToShareableHandle, cuMemRelease); the caller closes it. Returns
 * 0, or -1 with a static reason in *why.
 */
int nk_cuda_vmm_export(uint64_t base, int *fd, const char **why);

/* Why nk_cuda_vmm_import failed, for the status the daemon answers with. */
enum nk_vmm_error {
	NK_VMM_BAD_CHUNK = -1,  /* an fd or a size the driver refuses (the client's mistake) */
	NK_VMM_TOO_LARGE = -2,  /* a size larger than the chunk's allocation */
	NK_VMM_NO_MEMORY = -3,  /* no address space or memory for the mapping */
	NK_VMM_NO_DRIVER = -4,  /* the driver lacks the VMM calls */
};

/*
 * Imports `count` chunks from POSIX fds (sizes[i] bytes each, in order) and
 * maps them back to back on `device` with read and write access: one address
 * reservation of their sum, each chunk mapped at its offset. The fds stay
 * the caller's. Checks each size against the device's allocation
 * granularity and each chunk's device. On success *base is where the memory
 * starts and handles[i] each chunk's imported handle, both for
 * nk_cuda_vmm_unmap(). Returns 0 or an nk_vmm_error with a reason in `why`;
 * a failure leaves nothing mapped, reserved or imported. The calling thread
 * must have `device`'s primary context current (cudaSetDevice).
 */
int nk_cuda_vmm_import(int device, const int *fds, const uint64_t *sizes, unsigned count,
		       uint64_t *base, uint64_t *handles, char *why, size_t why_len);

/*
 * Undoes nk_cuda_vmm_import(): unmaps each chunk, frees the reservation and
 * releases the handles. Returns 0, or -1 if a driver call failed (what
 * could be undone still was).
 */
int nk_cuda_vmm_unmap(uint64_t base, const uint64_t *sizes, const uint64_t *handles,
		      unsigned count);

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
