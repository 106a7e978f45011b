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

void nc__region_track(nc_region *region)
{
	nc_conn *conn = region->conn;
	pthread_mutex_lock(&conn->lock);
	region->next = conn->regions;
	conn->regions = region;
	pthread_mutex_unlock(&conn->lock);
}

static void region_untrack(nc_region *region)
{
	nc_conn *conn = region->conn;
	pthread_mutex_lock(&conn->lock);
	for (nc_region **p = &conn->regions; *p; p = &(*p)->next) {
		if (*p == region) {
			*p = region->next;
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

static void region_release(nc_region *region)
{
	if (region->device < 0)
		munmap(region->data, region->size);
	nc__free(region->chunks);
	nc__free(region);
}

NC_API int nc_region_free(nc_region *region)
{
	if (!region)
		return 0;
	region_untrack(region);
	int rc = nc__region_unregister(region);
	region_release(region);
	return rc;
}

void nc__regions_release_all(nc_conn *conn)
{
	while (conn->regions) {
		nc_region *r = conn->regions;
		conn->regions = r->next;
		region_release(r);
	}
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
