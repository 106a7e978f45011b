/*
 * Host regions: shared memory the daemon maps too. A region is a memfd
 * sealed against shrinking (so the daemon can never fault on it), mapped
 * here and sent to the daemon once with SCM_RIGHTS.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "client/lib/internal.h"
#include "kernels/cuda_driver.h"
#include "proto/frame.h"


static int region_register(nc_conn *conn, int fd, size_t size, uint64_t id)
{
	Normd__RegisterRegion reg = NORMD__REGISTER_REGION__INIT;
	reg.region_id = id;
	reg.kind = NORMD__REGION_KIND__HOST_MEMFD;
	reg.size = size;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.body_case = NORMD__ENVELOPE__BODY_REGISTER_REGION;
	env.register_region = &reg;
	return nc__call_result(conn, &env, fd, NC__REGION_TIMEOUT_MS);
}

/* Maps `fd` here, registers it there; fd stays the caller's. */
static int region_create(nc_conn *conn, int fd, size_t size, nc_region **out)
{
	nc_region *region = nc__calloc(1, sizeof(*region));
	if (!region)
		return nc__fail(NC_ENOMEM, "out of memory for a region");
	region->data = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (region->data == MAP_FAILED) {
		int err = errno;
		nc__free(region);
		return nc__fail(err == ENOMEM ? NC_ENOMEM : NC_EINVALID_ARGUMENT,
				"mmap of %zu bytes failed: %s", size, strerror(err));
	}
	pthread_mutex_lock(&conn->lock);
	region->id = ++conn->next_region_id;
	pthread_mutex_unlock(&conn->lock);
	region->conn = conn;
	region->size = size;
	region->device = -1;
	int rc = region_register(conn, fd, size, region->id);
	if (rc) {
		munmap(region->data, size);
		nc__free(region);
		return rc;
	}
	nc__region_track(region);
	*out = region;
	return 0;
}

NC_API int nc_region_alloc_host(nc_conn *conn, size_t size, nc_region **out)
{
	if (!conn || !out || size == 0)
		return nc__fail(NC_EINVALID_ARGUMENT, "conn, out and a non-zero size are required");
	int fd = memfd_create("normd-region", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0)
		return nc__fail(NC_ENOMEM, "memfd_create: %s", strerror(errno));
	int rc = 0;
	if (ftruncate(fd, (off_t)size) != 0 || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) != 0)
		rc = nc__fail(NC_ENOMEM, "cannot size a %zu-byte memfd: %s", size, strerror(errno));
	if (rc == 0)
		rc = region_create(conn, fd, size, out);
	close(fd);
	return rc;
}

NC_API int nc_region_register_fd(nc_conn *conn, int fd, size_t size, nc_region **out)
{
	if (!conn || !out || fd < 0 || size == 0)
		return nc__fail(NC_EINVALID_ARGUMENT, "conn, out, an fd and a non-zero size are required");
	return region_create(conn, fd, size, out);
}

/* ---- the index ---------------------------------------------------------------------- */

#define INDEX_FIRST_BUCKETS 64

/* Fibonacci hashing: the product's top bits, which every bit of the key moves. */
static size_t bucket_of(uint64_t key, size_t buckets)
{
	return (size_t)((key * 0x9E3779B97F4A7C15ull) >> (64 - __builtin_ctzll(buckets)));
}

static int index_alloc(struct nc__region_index *ix, size_t buckets)
{
	nc_region **by_id = nc__calloc(buckets, sizeof(*by_id));
	nc_region **by_buffer = nc__calloc(buckets, sizeof(*by_buffer));
	struct nc__chunk_ref **by_chunk = nc__calloc(buckets, sizeof(*by_chunk));
	if (!by_id || !by_buffer || !by_chunk) {
		nc__free(by_id);
		nc__free(by_buffer);
		nc__free(by_chunk);
		return NC_ENOMEM;
	}
	nc__region_index_free(ix);
	ix->by_id = by_id;
	ix->by_buffer = by_buffer;
	ix->by_chunk = by_chunk;
	ix->buckets = buckets;
	ix->entries = 0;
	return 0;
}

int nc__region_index_init(struct nc__region_index *ix)
{
	return index_alloc(ix, INDEX_FIRST_BUCKETS);
}

void nc__region_index_free(struct nc__region_index *ix)
{
	nc__free(ix->by_id);
	nc__free(ix->by_buffer);
	nc__free(ix->by_chunk);
	memset(ix, 0, sizeof(*ix));
}

static void index_insert(struct nc__region_index *ix, nc_region *r)
{
	size_t b = bucket_of(r->id, ix->buckets);
	r->id_next = ix->by_id[b];
	ix->by_id[b] = r;
	ix->entries++;
	if (r->buffer_id) {
		b = bucket_of(r->buffer_id, ix->buckets);
		r->buffer_next = ix->by_buffer[b];
		ix->by_buffer[b] = r;
		ix->entries++;
	}
	for (unsigned i = 0; i < r->chunk_count; i++) {
		struct nc__chunk_ref *ref = &r->chunk_refs[i];
		ref->region = r;
		ref->index = i;
		b = bucket_of(r->chunks[i].base, ix->buckets);
		ref->next = ix->by_chunk[b];
		ix->by_chunk[b] = ref;
		ix->entries++;
	}
}

/* Doubles the buckets once they are fewer than the entries; a failed allocation keeps the old. */
static void index_grow(nc_conn *conn)
{
	struct nc__region_index *ix = &conn->index;
	if (ix->entries <= ix->buckets)
		return;
	struct nc__region_index bigger = {0};
	if (index_alloc(&bigger, ix->buckets * 2) != 0)
		return; /* longer chains, still right */
	nc__region_index_free(ix);
	*ix = bigger;
	for (nc_region *r = conn->regions; r; r = r->next)
		index_insert(ix, r);
}

void nc__region_unindex(nc_region *r)
{
	struct nc__region_index *ix = &r->conn->index;
	nc_region **p = &ix->by_id[bucket_of(r->id, ix->buckets)];
	while (*p && *p != r)
		p = &(*p)->id_next;
	if (*p) {
		*p = r->id_next;
		ix->entries--;
	}
	if (r->buffer_id) {
		p = &ix->by_buffer[bucket_of(r->buffer_id, ix->buckets)];
		while (*p && *p != r)
			p = &(*p)->buffer_next;
		if (*p) {
			*p = r->buffer_next;
			ix->entries--;
		}
	}
	for (unsigned i = 0; i < r->chunk_count; i++) {
		struct nc__chunk_ref **q = &ix->by_chunk[bucket_of(r->chunks[i].base, ix->buckets)];
		while (*q && *q != &r->chunk_refs[i])
			q = &(*q)->next;
		if (*q) {
			*q = r->chunk_refs[i].next;
			ix->entries--;
		}
	}
}

nc_region *nc__region_find(nc_conn *conn, uint64_t id)
{
	nc_region *r = conn->index.by_id[bucket_of(id, conn->index.buckets)];
	while (r && r->id != id)
		r = r->id_next;
	return r;
}

nc_region *nc__region_buffer_chain(nc_conn *conn, unsigned long long buffer_id)
{
	return conn->index.by_buffer[bucket_of(buffer_id, conn->index.buckets)];
}

struct nc__chunk_ref *nc__region_chunk_chain(nc_conn *conn, uint64_t base)
{
	return conn->index.by_chunk[bucket_of(base, conn->index.buckets)];
}

/* ---- the list ----------------------------------------------------------------------- */

void nc__region_track(nc_region *region)
{
	nc_conn *conn = region->conn;
	pthread_mutex_lock(&conn->lock);
	region->next = conn->regions;
	conn->regions = region;
	index_insert(&conn->index, region);
	index_grow(conn);
	pthread_mutex_unlock(&conn->lock);
}

static void region_untrack(nc_region *region)
{
	nc_conn *conn = region->conn;
	pthread_mutex_lock(&conn->lock);
	for (nc_region **p = &conn->regions; *p; p = &(*p)->next) {
		if (*p == region) {
			*p = region->next;
			nc__region_unindex(region);
			break;
		}
	}
	pthread_mutex_unlock(&conn->lock);
}

int nc__region_unregister(nc_region *region)
{
	Normd__UnregisterRegion unreg = NORMD__UNREGISTER_REGION__INIT;
	unreg.region_id = region->id;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.body_case = NORMD__ENVELOPE__BODY_UNREGISTER_REGION;
	env.unregister_region = &unreg;
	return nc__call_result(region->conn, &env, -1, NC__REGION_TIMEOUT_MS);
}

void nc__region_release(nc_region *region)
{
	if (region->device < 0)
		munmap(region->data, region->size);
	nc__free(region->chunks);
	nc__free(region->chunk_refs);
	nc__free(region);
}

NC_API int nc_region_free(nc_region *region)
{
	if (!region)
		return 0;
	region_untrack(region);
	int rc = nc__region_unregister(region);
	nc__region_release(region);
	return rc;
}

void nc__regions_release_all(nc_conn *conn)
{
	while (conn->regions) {
		nc_region *r = conn->regions;
		conn->regions = r->next;
		nc__region_release(r);
	}
	nc__region_index_free(&conn->index);
}

NC_API void *nc_region_data(const nc_region *region)
{
	return region ? region->data : NULL;
}

NC_API size_t nc_region_size(const nc_region *region)
{
	return region ? region->size : 0;
}

NC_API uint64_t nc_region_id(const nc_region *region)
{
	return region ? region->id : 0;
}

NC_API struct nc_tensor nc_tensor_at(const nc_region *region, const void *ptr)
{
	struct nc_tensor t = {0, 0};
	if (!region)
		return t;
	t.region = region->id;
	/* A pointer outside the mapping yields an offset the daemon refuses. */
	const char *p = ptr, *base = region->data;
	t.offset = (p >= base) ? (uint64_t)(p - base) : UINT64_MAX;
	return t;
}
