/*
 * Registered memory. Each connection names its regions by ids it chooses;
 * the ids live in that connection's table only, so no client can name
 * another's memory. A region is reference-counted: the table holds one
 * reference and every job using it one more, so unregistering or
 * disconnecting with jobs in flight unmaps only after those jobs end.
 *
 * HOST_MEMFD regions must be memfds sealed against shrinking (the daemon
 * adds F_SEAL_SHRINK itself when the client allowed sealing): otherwise the
 * client could truncate the file under a running job and fault the daemon.
 * CUDA_VMM_FD regions come as one fd per chunk; their shape is checked here
 * (region_check_chunks), their import is the CUDA backend's.
 */
#include "daemon/server.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon/log.h"
#include "proto/frame.h"

/* Regions are made on libuv's thread pool (dispatch.c) and freed on the loop. */
static _Atomic uint64_t live_regions;
static _Atomic uint64_t live_bytes;

/*
 * Mappings of client memory, daemon-wide, against a cap (region_mappings_init).
 * Every memfd region is one mmap, and every opened CUDA IPC handle one more,
 * all in a process whose mappings vm.max_map_count bounds: once that is
 * reached every mmap fails, malloc's included, for every client. A mapping
 * is reserved on the loop thread before it is made (dispatch.c) and given
 * back when it is unmapped, or when making it failed.
 */
static _Atomic uint64_t live_mappings;
static uint64_t max_mappings = UINT64_MAX;

bool region_mapping_reserve(void)
{
	uint64_t have = atomic_load(&live_mappings);
	do {
		if (have >= max_mappings)
			return false;
	} while (!atomic_compare_exchange_weak(&live_mappings, &have, have + 1));
	return true;
}

void region_mapping_release(void)
{
	atomic_fetch_sub(&live_mappings, 1);
}

bool region_mapping_reserve_n(unsigned n)
{
	uint64_t have = atomic_load(&live_mappings);
	do {
		if (have > max_mappings || max_mappings - have < n)
			return false;
	} while (!atomic_compare_exchange_weak(&live_mappings, &have, have + n));
	return true;
}

void region_mapping_release_n(unsigned n)
{
	atomic_fetch_sub(&live_mappings, n);
}

uint64_t region_mappings_live(void)
{
	return atomic_load(&live_mappings);
}

uint64_t region_mappings_cap(void)
{
	return max_mappings;
}

/* The first number in `path`, or `fallback` when it cannot be read. */
static uint64_t read_proc_number(const char *path, uint64_t fallback)
{
	FILE *f = fopen(path, "re");
	unsigned long long v;
	if (!f)
		return fallback;
	if (fscanf(f, "%llu", &v) != 1)
		v = fallback;
	fclose(f);
	return v;
}

/* Lines of /proc/self/maps: the mappings this process has now. */
static uint64_t count_own_mappings(void)
{
	FILE *f = fopen("/proc/self/maps", "re");
	uint64_t lines = 0;
	int ch;
	if (!f)
		return 0;
	while ((ch = getc(f)) != EOF)
		lines += ch == '\n';
	fclose(f);
	return lines;
}

uint64_t region_mappings_init(uint64_t configured)
{
	uint64_t limit = read_proc_number("/proc/sys/vm/max_map_count", REGION_DEFAULT_MAP_COUNT);
	uint64_t own = count_own_mappings();
	uint64_t room = limit > own ? limit - own : 0;
	uint64_t derived =
	    room > 2 * REGION_MAPPING_MARGIN ? room - REGION_MAPPING_MARGIN : room / 2;
	max_mappings = configured ? configured : derived;
	if (max_mappings == 0)
		max_mappings = 1;
	log_info("event=mapping_cap max_mappings=%llu source=%s max_map_count=%llu "
		 "mappings_at_start=%llu margin=%llu",
		 (unsigned long long)max_mappings, configured ? "config" : "max_map_count",
		 (unsigned long long)limit, (unsigned long long)own,
		 (unsigned long long)REGION_MAPPING_MARGIN);
	if (configured > derived)
		log_warn(
		    "event=mapping_cap_high max_mappings=%llu room=%llu reason=\"max_mappings "
		    "leaves less than %llu mappings of vm.max_map_count (%llu) for the daemon's "
		    "own allocations\"",
		    (unsigned long long)configured, (unsigned long long)room,
		    (unsigned long long)REGION_MAPPING_MARGIN, (unsigned long long)limit);
	return max_mappings;
}

uint64_t region_live_count(void)
{
	return atomic_load(&live_regions);
}

uint64_t region_live_bytes(void)
{
	return atomic_load(&live_bytes);
}

void region_table_init(struct region_table *table)
{
	memset(table, 0, sizeof(*table));
}

static size_t region_slot(uint64_t id, size_t capacity)
{
	/* Fibonacci hashing spreads sequential ids. */
	return (size_t)((id * 11400714819323198485ull) >> 32) & (capacity - 1);
}

struct region *region_lookup(const struct region_table *table, uint64_t id)
{
	if (table->capacity == 0)
		return NULL;
	for (size_t i = region_slot(id, table->capacity);; i = (i + 1) & (table->capacity - 1)) {
		struct region *r = table->slots[i];
		if (!r)
			return NULL;
		if (r->id == id)
			return r;
	}
}

static void region_place(struct region **slots, size_t capacity, struct region *region)
{
	size_t i = region_slot(region->id, capacity);
	while (slots[i])
		i = (i + 1) & (capacity - 1);
	slots[i] = region;
}

static int region_table_grow(struct region_table *table)
{
	size_t capacity = table->capacity ? table->capacity * 2 : 16;
	struct region **slots = nc__calloc(capacity, sizeof(*slots));
	if (!slots)
		return NC_ENOMEM;
	for (size_t i = 0; i < table->capacity; i++) {
		if (table->slots[i])
			region_place(slots, capacity, table->slots[i]);
	}
	nc__free(table->slots);
	table->slots = slots;
	table->capacity = capacity;
	return 0;
}

int region_insert(struct region_table *table, struct region *region)
{
	if (region_lookup(table, region->id))
		return NC_EALREADY_EXISTS;
	/* Keep the load factor under one half. */
	if ((table->count + 1) * 2 > table->capacity) {
		int rc = region_table_grow(table);
		if (rc)
			return rc;
	}
	region_place(table->slots, table->capacity, region);
	table->count++;
	table->mapped_bytes += region->size;
	return 0;
}

struct region *region_remove(struct region_table *table, uint64_t id)
{
	if (table->capacity == 0)
		return NULL;
	size_t mask = table->capacity - 1, i = region_slot(id, table->capacity);
	while (table->slots[i] && table->slots[i]->id != id)
		i = (i + 1) & mask;
	struct region *found = table->slots[i];
	if (!found)
		return NULL;
	table->slots[i] = NULL;
	table->count--;
	table->mapped_bytes -= found->size;
	/* Re-place the rest of the probe run so lookups still find them. */
	for (size_t j = (i + 1) & mask; table->slots[j]; j = (j + 1) & mask) {
		struct region *r = table->slots[j];
		table->slots[j] = NULL;
		region_place(table->slots, table->capacity, r);
	}
	return found;
}

void region_table_clear(struct region_table *table)
{
	for (size_t i = 0; i < table->capacity; i++) {
		if (table->slots[i])
			region_unref(table->slots[i]);
	}
	nc__free(table->slots);
	region_table_init(table);
}

void region_ref(struct region *region)
{
	region->refs++;
}

void region_unmap_memfd(struct region *region)
{
	if (region->base) {
		munmap(region->base, region->mapped_size);
		region_mapping_release();
	}
}

void region_unref(struct region *region)
{
	if (!region || --region->refs > 0)
		return;
	if (region->release)
		region->release(region);
	else if (region->kind == NORMD__REGION_KIND__HOST_MEMFD)
		region_unmap_memfd(region);
	atomic_fetch_sub(&live_regions, 1);
	atomic_fetch_sub(&live_bytes, region->mapped_size);
	nc__free(region);
}

int region_check_chunks(const Normd__RegisterRegion *msg, unsigned fd_count, char *why,
			size_t why_len)
{
	size_t n = msg->n_chunk_sizes;
	if (msg->kind != NORMD__REGION_KIND__CUDA_VMM_FD) {
		if (n == 0)
			return 0;
		snprintf(why, why_len, "chunk_sizes apply to CUDA_VMM_FD regions only (kind %d)",
			 (int)msg->kind);
		return NC_EINVALID_ARGUMENT;
	}
	if (n == 0 || n > NC_VMM_MAX_CHUNKS) {
		snprintf(why, why_len, "a CUDA_VMM_FD region has 1 to %d chunks, not %zu",
			 NC_VMM_MAX_CHUNKS, n);
		return NC_EINVALID_ARGUMENT;
	}
	if (fd_count != n) {
		snprintf(why, why_len, "the frame carried %u fds for %zu chunks (one fd per chunk)",
			 fd_count, n);
		return NC_EINVALID_ARGUMENT;
	}
	uint64_t total = 0;
	for (size_t i = 0; i < n; i++) {
		if (msg->chunk_sizes[i] == 0 ||
		    __builtin_add_overflow(total, msg->chunk_sizes[i], &total)) {
			snprintf(why, why_len, "chunk %zu has size %llu", i,
				 (unsigned long long)msg->chunk_sizes[i]);
			return NC_EINVALID_ARGUMENT;
		}
	}
	if (total != msg->size) {
		snprintf(why, why_len, "size %llu is not the sum of the chunk sizes (%llu)",
			 (unsigned long long)msg->size, (unsigned long long)total);
		return NC_EINVALID_ARGUMENT;
	}
	return 0;
}

struct region *region_find_handle(const struct region_table *table, const uint8_t handle[64],
				  int device)
{
	for (size_t i = 0; i < table->capacity; i++) {
		struct region *r = table->slots[i];
		if (r && r->kind == NORMD__REGION_KIND__CUDA_IPC && r->device == device &&
		    !memcmp(r->handle, handle, 64))
			return r;
	}
	return NULL;
}

struct region *region_new(uint64_t id, Normd__RegionKind kind, uint64_t size, int device)
{
	struct region *region = nc__calloc(1, sizeof(*region));
	if (!region)
		return NULL;
	region->id = id;
	region->kind = kind;
	region->size = size;
	region->mapped_size = (size_t)size;
	region->device = device;
	region->refs = 1;
	atomic_fetch_add(&live_regions, 1);
	atomic_fetch_add(&live_bytes, region->mapped_size);
	return region;
}

/* Makes sure the file cannot shrink under us; adds the seal if allowed. */
static int memfd_seal_check(int fd, char *why, size_t why_len)
{
	int seals = fcntl(fd, F_GET_SEALS);
	if (seals < 0) {
		snprintf(why, why_len, "the fd is not a memfd (F_GET_SEALS: %s)", strerror(errno));
		return NC_EINVALID_ARGUMENT;
	}
	if (seals & F_SEAL_SHRINK)
		return 0;
	if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) == 0)
		return 0;
	snprintf(why, why_len,
		 "the memfd can shrink and cannot be sealed: create it with MFD_ALLOW_SEALING");
	return NC_EINVALID_ARGUMENT;
}

int region_map_memfd(int fd, uint64_t id, uint64_t size, struct region **out, char *why,
		     size_t why_len)
{
	struct stat st;
	int rc = memfd_seal_check(fd, why, why_len);
	if (rc)
		goto out_close;
	if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
		snprintf(why, why_len, "the fd is not a regular memfd");
		rc = NC_EINVALID_ARGUMENT;
		goto out_close;
	}
	if ((uint64_t)st.st_size < size || size > SIZE_MAX) {
		snprintf(why, why_len, "size %llu is larger than the memfd (%lld bytes)",
			 (unsigned long long)size, (long long)st.st_size);
		rc = NC_EOUT_OF_RANGE;
		goto out_close;
	}
	void *base = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (base == MAP_FAILED) {
		snprintf(why, why_len, "mmap of %llu bytes failed: %s", (unsigned long long)size,
			 strerror(errno));
		rc = errno == ENOMEM ? NC_ERESOURCE_EXHAUSTED : NC_EINVALID_ARGUMENT;
		goto out_close;
	}
	struct region *region = region_new(id, NORMD__REGION_KIND__HOST_MEMFD, size, -1);
	if (!region) {
		munmap(base, (size_t)size);
		snprintf(why, why_len, "out of memory");
		rc = NC_ENOMEM;
		goto out_close;
	}
	region->base = base;
	region->file_dev = (uint64_t)st.st_dev;
	region->file_ino = (uint64_t)st.st_ino;
	*out = region;
	rc = 0;
out_close:
	close(fd);
	return rc;
}
