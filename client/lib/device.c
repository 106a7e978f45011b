/*
 * Device memory (CUDA backend): registering a cudaMalloc allocation through
 * a CUDA IPC handle, the per-connection cache that registers allocations on
 * first use, enqueueing a job named by device pointers, and running a job in
 * order with a caller's stream.
 *
 * The allocation is found from any pointer inside it with the driver's
 * pointer attributes (reached through the runtime, never by linking
 * libcuda); the handle names the allocation's base and tensors are offsets
 * from it. The cache is keyed by the driver's buffer id, which is never
 * reused, so a buffer freed and allocated again at the same address is
 * registered again (its handle differs).
 */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "client/lib/internal.h"
#include "kernels/cuda_driver.h"
#include "proto/frame.h"
#include "proto/job_roles.h"

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
	if (!info->ipc_capable)
		return nc__fail(NC_EUNSUPPORTED,
				"pointer %p is not exportable with cudaIpcGetMemHandle (VMM/cuMemCreate "
				"memory?); use cudaMalloc",
				ptr);
	return 0;
}

static void device_sweep_stale(nc_conn *conn);

NC_API int nc_region_register_device(nc_conn *conn, const void *ptr, nc_region **out)
{
	if (!conn || !ptr || !out)
		return nc__fail(NC_EINVALID_ARGUMENT, "conn, ptr and out must not be NULL");
	struct nk_cuda_pointer_info info;
	int rc = device_pointer_info(ptr, &info);
	if (rc)
		return rc;
	device_sweep_stale(conn);
	rc = device_region_register(conn, &info, out);
	if (rc == 0)
		nc__region_track(*out);
	return rc;
}

/*
 * Unregisters the lazily registered regions whose allocation is gone (freed,
 * or its address reused by another allocation): otherwise the daemon's
 * mapping would keep freed memory alive. Called on a cache miss.
 */
static void device_sweep_stale(nc_conn *conn)
{
	nc_region *stale = NULL;
	pthread_mutex_lock(&conn->lock);
	for (nc_region **p = &conn->regions; *p;) {
		nc_region *r = *p;
		struct nk_cuda_pointer_info info;
		const char *why;
		if (r->lazy && (nk_cuda_pointer_info(r->data, &info, &why) != 0 ||
				info.buffer_id != r->buffer_id)) {
			*p = r->next;
			r->next = stale;
			stale = r;
			continue;
		}
		p = &r->next;
	}
	pthread_mutex_unlock(&conn->lock);
	while (stale) {
		nc_region *r = stale;
		stale = r->next;
		nc__region_unregister(r);
		nc__free(r);
	}
}

/* The tensor at `ptr` in the lazily registered region of allocation `buffer_id`, if any. */
static bool lazy_tensor_lookup(nc_conn *conn, unsigned long long buffer_id, const void *ptr,
			       struct nc_tensor *out)
{
	bool found = false;
	pthread_mutex_lock(&conn->lock);
	for (nc_region *r = conn->regions; r; r = r->next) {
		if (r->lazy && r->buffer_id == buffer_id) {
			out->region = r->id;
			out->offset = (uint64_t)((uintptr_t)ptr - (uintptr_t)r->data);
			found = true;
			break;
		}
	}
	pthread_mutex_unlock(&conn->lock);
	return found;
}

NC_API int nc_tensor_device(nc_conn *conn, const void *ptr, struct nc_tensor *out)
{
	if (!conn || !out)
		return nc__fail(NC_EINVALID_ARGUMENT, "conn and out must not be NULL");
	if (!ptr) {
		out->region = out->offset = 0;
		return 0;
	}
	/*
	 * A registered allocation is known by its buffer id alone, the cheapest
	 * query: what the full one checks (device memory, exportable) was
	 * checked when it was registered, and an id is never reused.
	 */
	unsigned long long buffer_id;
	if (nk_cuda_pointer_buffer_id(ptr, &buffer_id) == 0 &&
	    lazy_tensor_lookup(conn, buffer_id, ptr, out))
		return 0;
	struct nk_cuda_pointer_info info;
	int rc = device_pointer_info(ptr, &info);
	if (rc)
		return rc;
	if (lazy_tensor_lookup(conn, info.buffer_id, ptr, out))
		return 0;
	device_sweep_stale(conn);
	nc_region *region;
	rc = device_region_register(conn, &info, &region);
	if (rc)
		return rc;
	region->lazy = true;
	nc__region_track(region);
	out->region = region->id;
	out->offset = (uint64_t)((uintptr_t)ptr - info.base);
	return 0;
}

/* The tensor fields of a job in role order (proto/job_roles.h), for nc_job_enqueue_device. */
static void job_tensor_fields(struct nc_job *job, struct nc_tensor *fields[NC_JOB_TENSORS])
{
	_Static_assert(NC__ROLE_MAIN_GRAD == NC_JOB_TENSORS - 1,
		       "struct nc_job's tensors are the first roles of the table, in order");
	struct nc_tensor *in_order[NC_JOB_TENSORS] = {
		&job->x,  &job->y,  &job->mean,   &job->rstd,  &job->gamma,     &job->beta,
		&job->dy, &job->dx, &job->dgamma, &job->dbeta, &job->main_grad,
	};
	memcpy(fields, in_order, sizeof(in_order));
}

NC_API int nc_job_enqueue_device(nc_conn *conn, const struct nc_job *job,
				 const void *const ptrs[NC_JOB_TENSORS], void *stream)
{
	if (!conn || !job || !ptrs)
		return nc__fail(NC_EINVALID_ARGUMENT, "conn, job and ptrs must not be NULL");
	struct nc_job resolved = *job;
	struct nc_tensor *fields[NC_JOB_TENSORS];
	job_tensor_fields(&resolved, fields);
	for (int i = 0; i < NC_JOB_TENSORS; i++) {
		if (!ptrs[i])
			continue;
		int rc = nc_tensor_device(conn, ptrs[i], fields[i]);
		if (rc) {
			/* The message says which tensor; nc_last_error() is rewritten below. */
			char why[192];
			snprintf(why, sizeof(why), "%s", nc_last_error());
			return nc__fail(rc, "tensor %s: %s",
					nc__job_role_name((enum nc__job_role)i), why);
		}
	}
	return nc_job_enqueue(conn, &resolved, stream);
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
