/*
 * Device memory (CUDA backend): registering a cudaMalloc allocation through
 * a CUDA IPC handle or VMM mappings through POSIX fds, the per-connection
 * cache that registers memory on first use, enqueueing a job named by
 * device pointers, and running a job in order with a caller's stream.
 *
 * The memory is found from any pointer inside it with the driver's pointer
 * attributes (reached through the runtime, never by linking libcuda).
 * cudaMalloc memory: the handle names the allocation's base and tensors are
 * offsets from it; the cache is keyed by the driver's buffer id, which is
 * never reused, so a buffer freed and allocated again at the same address
 * is registered again (its handle differs).
 *
 * VMM memory (cuMemCreate chunks mapped back to back, as PyTorch's
 * expandable segments are): a region is the consecutive mappings that cover
 * the tensor that asked for it and, around them, up to VMM_RUN_CHUNKS
 * mapped neighbours (one registration serves the tensors the allocator
 * places near it on later steps; a region per tensor's own chunks made a
 * training step register a region or two a step), each exported as a
 * POSIX fd, all sent in one RegisterRegion frame; tensors are offsets from
 * the first mapping's start. The hazard is a chunk unmapped and another
 * created at the same address: the daemon's import still holds the old
 * memory, so a cached registration must never serve it. The rule: a cached
 * VMM region serves a tensor only if the mappings the tensor touches are, at
 * this call, the same mappings (start, size) of the same physical
 * allocations (the driver's memory block id, unique for the process's life)
 * as when the region was registered, which makes the job right (its bytes,
 * bounds-checked by the daemon, lie in them). Its other mappings are checked
 * too, at most every VMM_RECHECK_NS (each is a driver query): a region with
 * any chunk changed is marked stale and never given out again. A sweep (at
 * a miss, and after a hit every VMM_RECHECK_NS while the connection has VMM
 * regions) unregisters it unless a job being assembled by
 * nc_job_enqueue_device has it pinned, or, for callers of
 * nc_tensor_device_range whose job this library does not see, it was given
 * out less than VMM_GRACE_NS ago: a job naming it must reach the daemon
 * first. So the daemon lets go of memory the process freed. With no byte
 * count (nc_tensor_device) the region is the tensor's own chunks and all of
 * them are checked at every lookup, as the daemon's bounds check then only
 * knows the region.
 */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "client/lib/internal.h"
#include "kernels/cuda_driver.h"
#include "proto/frame.h"
#include "proto/job_roles.h"

/* How often a VMM region given out for the chunks a tensor touches has all its chunks checked. */
#define VMM_RECHECK_NS 100000000ull
/* How long a stale VMM region stays registered after it was last given out (its job is sent). */
#define VMM_GRACE_NS 100000000ull
/* The mappings a new VMM region takes in around the tensor that asked for it. */
#define VMM_RUN_CHUNKS 32

/*
 * The regions nc_job_enqueue_device has given out for the job it assembles
 * on this thread, pinned until the job is sent: no sweep unregisters them
 * before the daemon has seen the job that names them.
 */
struct pin_set {
	nc_conn *conn;
	nc_region *regions[NC_JOB_ALL_TENSORS];
	unsigned count;
};
static _Thread_local struct pin_set *active_pins;

/* Pins a region being given out (conn->lock held) if a job is being assembled. */
static void pin_given_out(nc_conn *conn, nc_region *r)
{
	struct pin_set *pins = active_pins;
	if (pins && pins->conn == conn && pins->count < NC_JOB_ALL_TENSORS) {
		r->pins++;
		pins->regions[pins->count++] = r;
	}
}

static void unpin_all(struct pin_set *pins)
{
	pthread_mutex_lock(&pins->conn->lock);
	for (unsigned i = 0; i < pins->count; i++)
		pins->regions[i]->pins--;
	pthread_mutex_unlock(&pins->conn->lock);
	pins->count = 0;
}

static int device_region_register(nc_conn *conn, const struct nk_cuda_pointer_info *info,
				  nc_region **out)
{
	if (conn->info.server_pid == (uint32_t)getpid())
		return nc__fail(NC_EINVALID_ARGUMENT,
				"the daemon runs in this process; CUDA IPC cannot import from it");
	cudaIpcMemHandle_t handle;
	cudaError_t err = cudaIpcGetMemHandle(&handle, (void *)(uintptr_t)info->base);
	if (err != cudaSuccess) {
		cudaGetLastError();
		return nc__fail(NC_EUNSUPPORTED, "cudaIpcGetMemHandle: %s", cudaGetErrorString(err));
	}
	nc_region *region = nc__calloc(1, sizeof(*region));
	if (!region)
		return nc__fail(NC_ENOMEM, "out of memory for a region");
	pthread_mutex_lock(&conn->lock);
	region->id = ++conn->next_region_id;
	pthread_mutex_unlock(&conn->lock);
	region->conn = conn;
	region->data = (void *)(uintptr_t)info->base;
	region->size = (size_t)info->size;
	region->device = info->device;
	region->buffer_id = info->buffer_id;

	Normd__RegisterRegion reg = NORMD__REGISTER_REGION__INIT;
	reg.region_id = region->id;
	reg.kind = NORMD__REGION_KIND__CUDA_IPC;
	reg.has_device = reg.has_handle = true;
	reg.device = info->device;
	reg.handle.data = (uint8_t *)&handle;
	reg.handle.len = sizeof(handle);
	reg.size = info->size;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.body_case = NORMD__ENVELOPE__BODY_REGISTER_REGION;
	env.register_region = &reg;
	int rc = nc__call_result(conn, &env, -1, NC__REGION_TIMEOUT_MS);
	if (rc) {
		nc__free(region);
		return rc;
	}
	*out = region;
	return 0;
}

/* Looks the pointer's allocation up and refuses what cannot be exported. */
static int device_pointer_info(const void *ptr, struct nk_cuda_pointer_info *info)
{
	const char *why = NULL;
	if (nk_cuda_pointer_info(ptr, info, &why) != 0)
		return nc__fail(NC_EINVALID_ARGUMENT, "pointer %p: %s", ptr, why);
	if (info->managed)
		return nc__fail(NC_EUNSUPPORTED,
				"pointer %p is managed memory (cudaMallocManaged), which CUDA IPC "
				"cannot export; use cudaMalloc",
				ptr);
	if (info->from_pool)
		return nc__fail(NC_EUNSUPPORTED,
				"pointer %p comes from a memory pool (cudaMallocAsync), which CUDA "
				"IPC cannot export; use cudaMalloc",
				ptr);
	if (!info->ipc_capable && !info->vmm_fd_capable)
		return nc__fail(NC_EUNSUPPORTED,
				"pointer %p is neither cudaMalloc memory (CUDA IPC) nor VMM memory "
				"created with the POSIX file descriptor handle type "
				"(cuMemCreate's requestedHandleTypes); use cudaMalloc",
				ptr);
	return 0;
}

static void device_sweep_stale(nc_conn *conn);

/* The mappings covering [ptr, ptr + bytes) into chunks[]; their count, or a negative NC_E*. */
static int vmm_walk(const void *ptr, size_t bytes, int device,
		    struct nk_cuda_vmm_chunk chunks[NC_VMM_MAX_CHUNKS])
{
	const char *why = NULL;
	int n = nk_cuda_vmm_chunks(ptr, bytes, device, chunks, NC_VMM_MAX_CHUNKS, &why);
	if (n < 0)
		return nc__fail(NC_EINVALID_ARGUMENT, "VMM memory at %p (%zu bytes): %s", ptr, bytes,
				why);
	if (n > NC_VMM_MAX_CHUNKS)
		return nc__fail(NC_EUNSUPPORTED,
				"VMM memory at %p (%zu bytes) spans more than %d mappings (chunks of "
				"%llu bytes); normd registers at most %d per region",
				ptr, bytes, NC_VMM_MAX_CHUNKS, (unsigned long long)chunks[0].size,
				NC_VMM_MAX_CHUNKS);
	return n;
}

/* Exports each chunk as a POSIX fd and registers them as one CUDA_VMM_FD region. */
static int vmm_region_register(nc_conn *conn, int device, const struct nk_cuda_vmm_chunk *chunks,
			       unsigned count, nc_region **out)
{
	int fds[NC_VMM_MAX_CHUNKS];
	uint64_t sizes[NC_VMM_MAX_CHUNKS], total = 0;
	unsigned exported = 0;
	int rc = 0;
	nc_region *region = nc__calloc(1, sizeof(*region));
	struct nk_cuda_vmm_chunk *copy = nc__calloc(count, sizeof(*copy));
	struct nc__chunk_ref *refs = nc__calloc(count, sizeof(*refs));
	if (!region || !copy || !refs) {
		rc = nc__fail(NC_ENOMEM, "out of memory for a region");
		goto out;
	}
	for (; exported < count; exported++) {
		const char *why = NULL;
		if (nk_cuda_vmm_export(chunks[exported].base, &fds[exported], &why) != 0) {
			rc = nc__fail(NC_EUNSUPPORTED, "VMM chunk at 0x%llx: %s",
				      (unsigned long long)chunks[exported].base, why);
			goto out;
		}
		sizes[exported] = chunks[exported].size;
		total += chunks[exported].size;
	}
	memcpy(copy, chunks, count * sizeof(*copy));
	pthread_mutex_lock(&conn->lock);
	region->id = ++conn->next_region_id;
	pthread_mutex_unlock(&conn->lock);
	region->conn = conn;
	region->data = (void *)(uintptr_t)chunks[0].base;
	region->size = (size_t)total;
	region->device = device;
	region->chunk_count = count;
	region->chunks = copy;
	region->chunk_refs = refs;

	Normd__RegisterRegion reg = NORMD__REGISTER_REGION__INIT;
	reg.region_id = region->id;
	reg.kind = NORMD__REGION_KIND__CUDA_VMM_FD;
	reg.has_device = true;
	reg.device = device;
	reg.size = total;
	reg.n_chunk_sizes = count;
	reg.chunk_sizes = sizes;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.body_case = NORMD__ENVELOPE__BODY_REGISTER_REGION;
	env.register_region = &reg;
	rc = nc__call_result_fds(conn, &env, fds, count, NC__REGION_TIMEOUT_MS);
out:
	/* The daemon has its own copies of the fds (or never will): ours go now. */
	for (unsigned i = 0; i < exported; i++)
		close(fds[i]);
	if (rc) {
		nc__free(copy);
		nc__free(refs);
		nc__free(region);
		return rc;
	}
	*out = region;
	return 0;
}

/* Registers the memory holding [ptr, ptr + bytes), described by `info`. */
static int device_register_range(nc_conn *conn, const void *ptr, size_t bytes,
				 const struct nk_cuda_pointer_info *info, nc_region **out)
{
	uint64_t start = (uint64_t)(uintptr_t)ptr;
	if (info->ipc_capable) {
		if (bytes > info->size - (start - info->base))
			return nc__fail(NC_EINVALID_ARGUMENT,
					"%zu bytes at %p run past the cudaMalloc allocation "
					"(%llu bytes at 0x%llx)",
					bytes, ptr, (unsigned long long)info->size,
					(unsigned long long)info->base);
		return device_region_register(conn, info, out);
	}
	struct nk_cuda_vmm_chunk chunks[NC_VMM_MAX_CHUNKS];
	int n = vmm_walk(ptr, bytes, info->device, chunks);
	if (n < 0)
		return n;
	return vmm_region_register(conn, info->device, chunks, (unsigned)n, out);
}

NC_API int nc_region_register_device_range(nc_conn *conn, const void *ptr, size_t bytes,
					   nc_region **out)
{
	if (!conn || !ptr || !out)
		return nc__fail(NC_EINVALID_ARGUMENT, "conn, ptr and out must not be NULL");
	struct nk_cuda_pointer_info info;
	int rc = device_pointer_info(ptr, &info);
	if (rc)
		return rc;
	device_sweep_stale(conn);
	rc = device_register_range(conn, ptr, bytes ? bytes : 1, &info, out);
	if (rc == 0)
		nc__region_track(*out);
	return rc;
}

NC_API int nc_region_register_device(nc_conn *conn, const void *ptr, nc_region **out)
{
	return nc_region_register_device_range(conn, ptr, 1, out);
}

/* Whether the chunk registered as `c` is still mapped at its place with the same memory. */
static bool vmm_chunk_current(const struct nk_cuda_vmm_chunk *c, int device)
{
	struct nk_cuda_vmm_chunk now;
	const char *why;
	return nk_cuda_vmm_chunks((const void *)(uintptr_t)c->base, 1, device, &now, 1, &why) == 1 &&
	       now.base == c->base && now.size == c->size && now.block_id == c->block_id;
}

/* Whether a lazily registered region's memory is gone (freed, remapped or reused). */
static bool device_region_stale(const nc_region *r)
{
	if (r->chunk_count == 0) {
		struct nk_cuda_pointer_info info;
		const char *why;
		return nk_cuda_pointer_info(r->data, &info, &why) != 0 ||
		       info.buffer_id != r->buffer_id;
	}
	for (unsigned i = 0; i < r->chunk_count; i++) {
		if (!vmm_chunk_current(&r->chunks[i], r->device))
			return true;
	}
	return false;
}

/* Marks a lazy VMM region stale (conn->lock held): no lookup gives it out again. */
static void vmm_mark_stale(nc_conn *conn, nc_region *r)
{
	if (!r->stale) {
		r->stale = true;
		conn->stale_vmm_regions++;
	}
}

/*
 * Unregisters the lazily registered regions whose memory is gone (freed, or
 * its address reused by another allocation; for VMM memory, any chunk
 * unmapped or remapped): otherwise the daemon's mapping would keep freed
 * memory alive. A region pinned by a job being assembled, or a VMM region
 * given out less than VMM_GRACE_NS ago (to a caller of
 * nc_tensor_device_range, whose job may not be sent yet), is only marked.
 * Called on a cache miss, and after a hit every VMM_RECHECK_NS while the
 * connection has VMM regions.
 */
static void device_sweep_stale(nc_conn *conn)
{
	nc_region *stale = NULL;
	pthread_mutex_lock(&conn->lock);
	uint64_t now = nc__now_ns(); /* under the lock: no hand-out can come after it */
	conn->last_sweep_ns = now;
	for (nc_region **p = &conn->regions; *p;) {
		nc_region *r = *p;
		if (!r->lazy || !(r->stale || device_region_stale(r))) {
			p = &r->next;
			continue;
		}
		if (r->pins > 0 || (r->chunk_count && r->handed_ns + VMM_GRACE_NS > now)) {
			if (r->chunk_count)
				vmm_mark_stale(conn, r);
			p = &r->next;
			continue;
		}
		if (r->stale)
			conn->stale_vmm_regions--;
		if (r->chunk_count)
			conn->lazy_vmm_regions--;
		*p = r->next;
		nc__region_unindex(r);
		r->next = stale;
		stale = r;
	}
	pthread_mutex_unlock(&conn->lock);
	while (stale) {
		nc_region *r = stale;
		stale = r->next;
		nc__region_unregister(r);
		nc__region_release(r);
	}
}

/*
 * Whether a hit should sweep (conn->lock held): VMM regions are checked in
 * full every VMM_RECHECK_NS even when nothing misses, so that memory the
 * process unmapped is let go of although no tensor asks for it again.
 */
static bool sweep_due(nc_conn *conn)
{
	return (conn->lazy_vmm_regions > 0 || conn->stale_vmm_regions > 0) &&
	       conn->last_sweep_ns + VMM_RECHECK_NS <= nc__now_ns();
}

/* The tensor at `ptr` in the lazily registered region of allocation `buffer_id`, if any. */
static bool lazy_tensor_lookup(nc_conn *conn, unsigned long long buffer_id, const void *ptr,
			       struct nc_tensor *out)
{
	bool found = false;
	pthread_mutex_lock(&conn->lock);
	for (nc_region *r = nc__region_buffer_chain(conn, buffer_id); r; r = r->buffer_next) {
		if (r->lazy && r->chunk_count == 0 && r->buffer_id == buffer_id) {
			out->region = r->id;
			out->offset = (uint64_t)((uintptr_t)ptr - (uintptr_t)r->data);
			pin_given_out(conn, r);
			found = true;
			break;
		}
	}
	bool sweep = found && sweep_due(conn);
	pthread_mutex_unlock(&conn->lock);
	if (sweep)
		device_sweep_stale(conn);
	return found;
}

/* Whether registered chunks r[k..k+count) are exactly `now` (same mappings, same memory). */
static bool vmm_chunks_equal(const struct nk_cuda_vmm_chunk *r, const struct nk_cuda_vmm_chunk *now,
			     unsigned count)
{
	for (unsigned i = 0; i < count; i++) {
		if (r[i].base != now[i].base || r[i].size != now[i].size ||
		    r[i].block_id != now[i].block_id)
			return false;
	}
	return true;
}

/* Whether r's chunks outside [k, k + count) (those the walk did not see) are current. */
static bool vmm_others_current(const nc_region *r, unsigned k, unsigned count)
{
	for (unsigned i = 0; i < r->chunk_count; i++) {
		if ((i < k || i >= k + count) && !vmm_chunk_current(&r->chunks[i], r->device))
			return false;
	}
	return true;
}

/*
 * The tensor at `ptr` in a lazily registered VMM region that holds all of
 * `chunks` (the mappings the tensor touches, as they are now) as they were
 * registered: the staleness rule at the top of this file. `strict` (the
 * caller did not say how many bytes the tensor spans): every chunk of the
 * region is checked now.
 */
static bool vmm_tensor_lookup(nc_conn *conn, int device, const struct nk_cuda_vmm_chunk *chunks,
			      unsigned count, bool strict, const void *ptr, struct nc_tensor *out)
{
	bool found = false;
	pthread_mutex_lock(&conn->lock);
	uint64_t now = nc__now_ns();
	for (struct nc__chunk_ref *ref = nc__region_chunk_chain(conn, chunks[0].base);
	     ref && !found; ref = ref->next) {
		nc_region *r = ref->region;
		unsigned k = ref->index;
		if (!r->lazy || r->stale || r->device != device || r->chunks[k].base != chunks[0].base ||
		    k + count > r->chunk_count || !vmm_chunks_equal(&r->chunks[k], chunks, count))
			continue;
		if (strict || r->checked_ns + VMM_RECHECK_NS <= now) {
			if (!vmm_others_current(r, k, count)) {
				vmm_mark_stale(conn, r);
				continue;
			}
			r->checked_ns = now;
		}
		r->handed_ns = now;
		pin_given_out(conn, r);
		out->region = r->id;
		out->offset = (uint64_t)((uintptr_t)ptr - (uintptr_t)r->data);
		found = true;
	}
	bool sweep = found && sweep_due(conn);
	pthread_mutex_unlock(&conn->lock);
	if (sweep)
		device_sweep_stale(conn);
	return found;
}

/*
 * Grows the run chunks[0..n) over the mappings next to it, to VMM_RUN_CHUNKS
 * at most: one registration then serves the tensors around this one too,
 * wherever the allocator places them on later steps. Returns the new count.
 */
static unsigned vmm_extend(int device, struct nk_cuda_vmm_chunk chunks[NC_VMM_MAX_CHUNKS],
			   unsigned n)
{
	bool back = true, forward = true;
	while (n < VMM_RUN_CHUNKS && (back || forward)) {
		struct nk_cuda_vmm_chunk c;
		const char *why;
		if (forward) {
			uint64_t end = chunks[n - 1].base + chunks[n - 1].size;
			forward = nk_cuda_vmm_chunks((const void *)(uintptr_t)end, 1, device, &c, 1,
						     &why) == 1 && c.base == end;
			if (forward)
				chunks[n++] = c;
		}
		if (back && n < VMM_RUN_CHUNKS) {
			uint64_t start = chunks[0].base;
			back = start > 0 &&
			       nk_cuda_vmm_chunks((const void *)(uintptr_t)(start - 1), 1, device, &c,
						  1, &why) == 1 &&
			       c.base + c.size == start;
			if (back) {
				memmove(chunks + 1, chunks, n * sizeof(*chunks));
				chunks[0] = c;
				n++;
			}
		}
	}
	return n;
}

/* Files a region registered for a tensor no cached region served in the cache; fills *out. */
static int lazy_register(const void *ptr, nc_region *region, struct nc_tensor *out)
{
	nc_conn *conn = region->conn;
	region->lazy = true;
	region->checked_ns = region->handed_ns = nc__now_ns();
	nc__region_track(region);
	pthread_mutex_lock(&conn->lock);
	if (region->chunk_count)
		conn->lazy_vmm_regions++;
	pin_given_out(conn, region);
	pthread_mutex_unlock(&conn->lock);
	out->region = region->id;
	out->offset = (uint64_t)((uintptr_t)ptr - (uintptr_t)region->data);
	return 0;
}

/*
 * nc_tensor_device_range for VMM memory. With `bytes` 1 (nc_tensor_device:
 * the caller did not say what the job will touch) the region is the
 * tensor's own chunks and a cached one serves only while all its chunks are
 * current, so that the daemon's bounds check stays the guard.
 */
static int vmm_tensor(nc_conn *conn, const void *ptr, size_t bytes, int device,
		      struct nc_tensor *out)
{
	bool strict = bytes <= 1;
	struct nk_cuda_vmm_chunk chunks[NC_VMM_MAX_CHUNKS];
	int n = vmm_walk(ptr, bytes, device, chunks);
	if (n < 0)
		return n;
	if (vmm_tensor_lookup(conn, device, chunks, (unsigned)n, strict, ptr, out))
		return 0;
	device_sweep_stale(conn);
	struct nk_cuda_vmm_chunk own[NC_VMM_MAX_CHUNKS];
	memcpy(own, chunks, (size_t)n * sizeof(*own));
	unsigned grown = strict ? (unsigned)n : vmm_extend(device, chunks, (unsigned)n);
	nc_region *region;
	int rc = vmm_region_register(conn, device, chunks, grown, &region);
	/* A refusal of the grown run (a limit, a neighbour that cannot be exported), not a lost
	 * daemon: the tensor's own chunks may still be taken. */
	if (rc && grown > (unsigned)n && rc != NC_ETIMEOUT && rc != NC_EDISCONNECTED && rc != NC_EIO)
		rc = vmm_region_register(conn, device, own, (unsigned)n, &region);
	return rc ? rc : lazy_register(ptr, region, out);
}

NC_API int nc_tensor_device_range(nc_conn *conn, const void *ptr, size_t bytes,
				  struct nc_tensor *out)
{
	if (!conn || !out)
		return nc__fail(NC_EINVALID_ARGUMENT, "conn and out must not be NULL");
	if (!ptr) {
		out->region = out->offset = 0;
		return 0;
	}
	/*
	 * A registered cudaMalloc allocation is known by its buffer id alone,
	 * the cheapest query: what the full one checks (device memory,
	 * exportable) was checked when it was registered, and an id is never
	 * reused. VMM memory is never cached by buffer id.
	 */
	unsigned long long buffer_id;
	if (nk_cuda_pointer_buffer_id(ptr, &buffer_id) == 0 &&
	    lazy_tensor_lookup(conn, buffer_id, ptr, out))
		return 0;
	struct nk_cuda_pointer_info info;
	int rc = device_pointer_info(ptr, &info);
	if (rc)
		return rc;
	if (!info.ipc_capable)
		return vmm_tensor(conn, ptr, bytes ? bytes : 1, info.device, out);
	if (lazy_tensor_lookup(conn, info.buffer_id, ptr, out))
		return 0;
	device_sweep_stale(conn);
	nc_region *region;
	rc = device_region_register(conn, &info, &region);
	return rc ? rc : lazy_register(ptr, region, out);
}

NC_API int nc_tensor_device(nc_conn *conn, const void *ptr, struct nc_tensor *out)
{
	return nc_tensor_device_range(conn, ptr, 1, out);
}

/* The tensor fields of a job and its variants, in role order (proto/job_roles.h). */
static void job_tensor_fields(struct nc_job *job, struct nc_job_ext *ext,
			      struct nc_tensor *fields[NC_JOB_ALL_TENSORS])
{
	_Static_assert(NC__ROLE_MAIN_GRAD == NC_JOB_TENSORS - 1 &&
			       NC__ROLE_RESIDUAL == NC_JOB_TENSORS &&
			       NC__ROLE_AMAX == NC_JOB_ALL_TENSORS - 1 &&
			       NC__ROLE_COUNT == NC_JOB_ALL_TENSORS,
		       "struct nc_job's tensors, then struct nc_job_ext's, are the roles in order");
	struct nc_tensor *in_order[NC_JOB_ALL_TENSORS] = {
		&job->x,	&job->y,	&job->mean,	    &job->rstd,
		&job->gamma,	&job->beta,	&job->dy,	    &job->dx,
		&job->dgamma,	&job->dbeta,	&job->main_grad,    &ext->residual,
		&ext->residual_out, &ext->ds,	&ext->scale,	    &ext->amax,
	};
	memcpy(fields, in_order, sizeof(in_order));
}

NC_API int nc_job_enqueue_device(nc_conn *conn, const struct nc_job *job,
				 const void *const ptrs[NC_JOB_TENSORS], void *stream)
{
	if (!ptrs)
		return nc__fail(NC_EINVALID_ARGUMENT, "conn, job and ptrs must not be NULL");
	const void *all[NC_JOB_ALL_TENSORS] = {0};
	memcpy(all, ptrs, NC_JOB_TENSORS * sizeof(*ptrs));
	return nc_job_enqueue_device_ext(conn, job, NULL, all, stream);
}

NC_API int nc_job_enqueue_device_ext(nc_conn *conn, const struct nc_job *job,
				     const struct nc_job_ext *ext,
				     const void *const ptrs[NC_JOB_ALL_TENSORS], void *stream)
{
	if (!conn || !job || !ptrs)
		return nc__fail(NC_EINVALID_ARGUMENT, "conn, job and ptrs must not be NULL");
	/* Without ext, the variants' pointers have no field to go to. */
	int count = ext ? NC_JOB_ALL_TENSORS : NC_JOB_TENSORS;
	for (int i = count; i < NC_JOB_ALL_TENSORS; i++) {
		if (ptrs[i])
			return nc__fail(NC_EINVALID_ARGUMENT, "tensor %s needs a struct nc_job_ext",
					nc__job_role_name((enum nc__job_role)i));
	}
	/*
	 * Before the pointers, whose registration a capture would refuse. Only
	 * with a device pointer is `stream` surely a CUDA stream (a job of host
	 * regions names a CPU-backend key there).
	 */
	bool device_pointers = false;
	for (int i = 0; i < count; i++)
		device_pointers |= ptrs[i] != NULL;
	int refused = device_pointers ? nc__refuse_capture(stream) : 0;
	if (refused)
		return refused;
	struct nc_job resolved = *job;
	struct nc_job_ext resolved_ext = {0};
	if (ext)
		resolved_ext = *ext;
	struct nc_tensor *fields[NC_JOB_ALL_TENSORS];
	job_tensor_fields(&resolved, &resolved_ext, fields);
	struct pin_set pins = {.conn = conn};
	active_pins = &pins;
	for (int i = 0; i < count; i++) {
		if (!ptrs[i])
			continue;
		/* The bytes the job reads or writes there: a VMM tensor may span several chunks. */
		uint64_t bytes = nc__role_bytes(job, ext, i);
		size_t span = bytes == 0 || bytes > SIZE_MAX ? 1 : (size_t)bytes;
		int rc = nc_tensor_device_range(conn, ptrs[i], span, fields[i]);
		if (rc) {
			/* The message says which tensor; nc_last_error() is rewritten below. */
			char why[192];
			snprintf(why, sizeof(why), "%s", nc_last_error());
			active_pins = NULL;
			unpin_all(&pins);
			return nc__fail(rc, "tensor %s: %s",
					nc__job_role_name((enum nc__job_role)i), why);
		}
	}
	active_pins = NULL;
	int rc = nc__job_enqueue(conn, &resolved, ext ? &resolved_ext : NULL, stream,
				 device_pointers);
	unpin_all(&pins); /* the job is on the socket (or refused): sweeps may take its regions */
	return rc;
}

NC_API int nc_job_run_on_stream(nc_conn *conn, const struct nc_job *job, void *stream,
				int timeout_ms, struct nc_job_result *result)
{
	return nc_job_run_on_stream_ext(conn, job, NULL, stream, timeout_ms, result);
}

NC_API int nc_job_run_on_stream_ext(nc_conn *conn, const struct nc_job *job,
				    const struct nc_job_ext *ext, void *stream, int timeout_ms,
				    struct nc_job_result *result)
{
	/* The daemon's stream cannot wait on ours: finish our queued work first. */
	cudaError_t err = cudaStreamSynchronize((cudaStream_t)stream);
	if (err != cudaSuccess) {
		int rc = nc__fail(NC_EINVALID_ARGUMENT, "cudaStreamSynchronize: %s",
				  cudaGetErrorString(err));
		if (result) {
			memset(result, 0, sizeof(*result));
			result->status = rc;
			snprintf(result->message, sizeof(result->message), "%s", nc_last_error());
		}
		return rc;
	}
	return nc_job_run_ext(conn, job, ext, timeout_ms, result);
}

/* ---- the IPC-event completion mode -------------------------------------------------------- */

#define NC__WAIT_EVENTS 64  /* events a connection records for the daemon to wait on */
#define NC__DONE_EVENTS 512 /* the daemon's done events a connection keeps open */

struct nc__events {
	pthread_mutex_t lock;
	cudaEvent_t wait[NC__WAIT_EVENTS]; /* ours, interprocess */
	uint8_t wait_handle[NC__WAIT_EVENTS][64];
	bool wait_busy[NC__WAIT_EVENTS];   /* its job's reply has not arrived yet */
	unsigned wait_count;
	struct nk_ipc_event_cache done;    /* the daemon's, opened from their handles */
};

static struct nc__events *events_of(nc_conn *conn)
{
	pthread_mutex_lock(&conn->lock);
	if (!conn->events) {
		conn->events = nc__calloc(1, sizeof(*conn->events));
		if (conn->events && nk_ipc_event_cache_init(&conn->events->done, NC__DONE_EVENTS)) {
			nc__free(conn->events);
			conn->events = NULL;
		}
		if (conn->events)
			pthread_mutex_init(&conn->events->lock, NULL);
	}
	struct nc__events *ev = conn->events;
	pthread_mutex_unlock(&conn->lock);
	return ev;
}

/* A free wait event (made on first need); its index, or -1. */
static int wait_event_take(struct nc__events *ev)
{
	int slot = -1;
	pthread_mutex_lock(&ev->lock);
	for (unsigned i = 0; i < ev->wait_count && slot < 0; i++) {
		if (!ev->wait_busy[i])
			slot = (int)i;
	}
	if (slot < 0 && ev->wait_count < NC__WAIT_EVENTS) {
		cudaIpcEventHandle_t h;
		unsigned i = ev->wait_count;
		if (cudaEventCreateWithFlags(&ev->wait[i], cudaEventInterprocess |
								   cudaEventDisableTiming) == cudaSuccess &&
		    cudaIpcGetEventHandle(&h, ev->wait[i]) == cudaSuccess) {
			memcpy(ev->wait_handle[i], &h, 64);
			ev->wait_count++;
			slot = (int)i;
		} else {
			cudaGetLastError();
		}
	}
	if (slot >= 0)
		ev->wait_busy[slot] = true;
	pthread_mutex_unlock(&ev->lock);
	return slot;
}

static void wait_event_give_back(struct nc__events *ev, int slot)
{
	pthread_mutex_lock(&ev->lock);
	ev->wait_busy[slot] = false;
	pthread_mutex_unlock(&ev->lock);
}

void nc__events_release(nc_conn *conn)
{
	struct nc__events *ev = conn->events;
	if (!ev)
		return;
	for (unsigned i = 0; i < ev->wait_count; i++)
		cudaEventDestroy(ev->wait[i]);
	nk_ipc_event_cache_destroy(&ev->done);
	pthread_mutex_destroy(&ev->lock);
	nc__free(ev);
	conn->events = NULL;
}

static int event_result_fail(struct nc_job_result *result, int rc)
{
	if (result) {
		memset(result, 0, sizeof(*result));
		result->status = rc;
		snprintf(result->message, sizeof(result->message), "%s", nc_last_error());
	}
	return rc;
}

NC_API int nc_job_run_event(nc_conn *conn, const struct nc_job *job, void *stream,
			    int timeout_ms, struct nc_job_result *result)
{
	return nc_job_run_event_ext(conn, job, NULL, stream, timeout_ms, result);
}

NC_API int nc_job_run_event_ext(nc_conn *conn, const struct nc_job *job,
				const struct nc_job_ext *ext, void *stream, int timeout_ms,
				struct nc_job_result *result)
{
	struct nc_job_result local;
	if (!result)
		result = &local;
	if (!conn || !job)
		return event_result_fail(result, nc__fail(NC_EINVALID_ARGUMENT,
							  "conn and job must not be NULL"));
	struct nc__events *ev = events_of(conn);
	int slot = ev ? wait_event_take(ev) : -1;
	if (slot < 0)
		return event_result_fail(result, nc__fail(NC_ERESOURCE_EXHAUSTED,
							  "no interprocess CUDA event available"));
	/*
	 * The daemon's stream waits for what the caller queued so far, unless
	 * all of it is done already: a GPU-side wait on another process's event
	 * costs a switch between the two contexts (~300 us on an H100).
	 */
	int rc = 0;
	uint64_t id = 0;
	uint8_t done[64];
	/*
	 * The legacy default stream (NULL) also orders work of other blocking
	 * streams that a query of it may not see: it always gets the event.
	 */
	cudaError_t idle = stream ? cudaStreamQuery((cudaStream_t)stream) : cudaErrorNotReady;
	if (idle != cudaSuccess && idle != cudaErrorNotReady) {
		cudaGetLastError();
		rc = nc__fail(NC_EINVALID_ARGUMENT, "cudaStreamQuery on the caller's stream failed");
	} else if (idle == cudaErrorNotReady &&
		   cudaEventRecord(ev->wait[slot], (cudaStream_t)stream) != cudaSuccess) {
		cudaGetLastError();
		rc = nc__fail(NC_EINVALID_ARGUMENT, "cudaEventRecord on the caller's stream failed");
	}
	if (rc == 0)
		rc = nc__job_submit_event(conn, job, ext,
					  idle == cudaSuccess ? NULL : ev->wait_handle[slot], true, &id);
	if (rc == 0)
		rc = nc__job_wait_event(conn, id, timeout_ms, result, done);
	else
		event_result_fail(result, rc);
	/* The reply comes after the daemon queued its wait: the event may be reused. */
	if (rc != NC_ETIMEOUT)
		wait_event_give_back(ev, slot);
	if (rc)
		return rc;
	static const uint8_t zero[64];
	if (!memcmp(done, zero, 64))
		return 0; /* answered after completion: nothing to wait for */
	/*
	 * The caller's stream waits for the job; this thread does not. A job
	 * already done needs no GPU-side wait on the daemon's event, which would
	 * cost a switch between the two processes' contexts.
	 */
	cudaEvent_t done_event = nk_ipc_event_open(&ev->done, done);
	cudaError_t state = done_event ? cudaEventQuery(done_event) : cudaErrorInvalidValue;
	if (state != cudaSuccess &&
	    (state != cudaErrorNotReady ||
	     cudaStreamWaitEvent((cudaStream_t)stream, done_event, 0) != cudaSuccess)) {
		cudaGetLastError();
		rc = nc__fail(NC_EDEVICE_ERROR, "cannot wait on the daemon's done event");
		result->status = rc;
		snprintf(result->message, sizeof(result->message), "%s", nc_last_error());
	}
	nk_ipc_event_release(&ev->done, done_event); /* a queued wait needs it no longer */
	return rc;
}
