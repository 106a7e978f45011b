/*
 * The per-device kernel-variant cache (see variant_cache.h).
 *
 * File format, one file per GPU, `<state_dir>/variants-<uuid>.txt`:
 *   normd-variants 2 <uuid hex> <NK_VARIANT_SET>
 *   <op> <dtype> <weight_dtype> <flags> <cols> <family> <threads> <rows_per_block> <vec_elems> <param> <source>
 * Any line that does not parse, or a header for another GPU, format or
 * variant set, makes the whole file ignored (with a warning): it is only a
 * cache. Only autotuned choices are written: a rule is cheaper to apply
 * again than to read, and a persisted rule would outlive a better one.
 */
#include "daemon/variant_cache.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <uv.h>

#include "daemon/log.h"
#include "proto/frame.h"

#define VARIANT_FILE_VERSION 2

struct variant_key {
	int64_t cols;
	uint8_t op, dtype, weight_dtype, flags;
};

struct variant_entry {
	bool used;
	struct variant_key key;
	struct nk_variant variant;
	enum variant_source source;
	uint64_t uses;
};

struct variant_cache {
	uv_mutex_t lock;
	int device;
	char uuid_hex[33];
	char path[512];               /* "" when there is no state directory */
	struct variant_entry *entries; /* open addressing */
	size_t capacity, count;
	uint64_t hits, misses;
	bool dirty;                   /* changed since loaded or saved */
};

static struct variant_key key_of(const struct nk_norm_args *a)
{
	struct variant_key k;
	memset(&k, 0, sizeof(k));
	k.cols = a->cols;
	k.op = (uint8_t)a->op;
	k.dtype = (uint8_t)a->dtype;
	k.weight_dtype = (uint8_t)a->weight_dtype;
	k.flags = (uint8_t)(((a->flags & NK_MEMORY_EFFICIENT) ? VK_MEMORY_EFFICIENT : 0) |
			    (a->gamma ? VK_GAMMA : 0) | (a->beta ? VK_BETA : 0));
	return k;
}

static bool key_equal(const struct variant_key *a, const struct variant_key *b)
{
	return a->cols == b->cols && a->op == b->op && a->dtype == b->dtype &&
	       a->weight_dtype == b->weight_dtype && a->flags == b->flags;
}

static size_t key_slot(const struct variant_key *k, size_t capacity)
{
	uint64_t h = (uint64_t)k->cols * 0x9e3779b97f4a7c15ull;
	h ^= ((uint64_t)k->op << 24 | (uint64_t)k->dtype << 16 | (uint64_t)k->weight_dtype << 8 |
	      k->flags) * 0xbf58476d1ce4e5b9ull;
	return (size_t)(h >> 17) & (capacity - 1);
}

static struct variant_entry *find_slot(struct variant_entry *entries, size_t capacity,
				       const struct variant_key *k)
{
	size_t i = key_slot(k, capacity);
	while (entries[i].used && !key_equal(&entries[i].key, k))
		i = (i + 1) & (capacity - 1);
	return &entries[i];
}

static int grow(struct variant_cache *cache)
{
	size_t capacity = cache->capacity ? cache->capacity * 2 : 64;
	struct variant_entry *entries = nc__calloc(capacity, sizeof(*entries));
	if (!entries)
		return -1;
	for (size_t i = 0; i < cache->capacity; i++) {
		if (cache->entries[i].used)
			*find_slot(entries, capacity, &cache->entries[i].key) = cache->entries[i];
	}
	nc__free(cache->entries);
	cache->entries = entries;
	cache->capacity = capacity;
	return 0;
}

/* Lock held. */
static void store_locked(struct variant_cache *cache, const struct variant_key *k,
			 const struct nk_variant *variant, enum variant_source source)
{
	if ((cache->count + 1) * 2 > cache->capacity && grow(cache) != 0)
		return; /* out of memory: simply not cached */
	struct variant_entry *e = find_slot(cache->entries, cache->capacity, k);
	if (!e->used)
		cache->count++;
	e->used = true;
	e->key = *k;
	e->variant = *variant;
	e->source = source;
	cache->dirty = true;
}

bool variant_cache_lookup(struct variant_cache *cache, const struct nk_norm_args *args,
			  struct nk_variant *out)
{
	struct variant_key k = key_of(args);
	bool hit = false;
	uv_mutex_lock(&cache->lock);
	if (cache->capacity) {
		struct variant_entry *e = find_slot(cache->entries, cache->capacity, &k);
		if (e->used) {
			*out = e->variant;
			e->uses++;
			hit = true;
		}
	}
	if (hit)
		cache->hits++;
	else
		cache->misses++;
	uv_mutex_unlock(&cache->lock);
	return hit;
}

void variant_cache_store(struct variant_cache *cache, const struct nk_norm_args *args,
			 const struct nk_variant *variant, enum variant_source source)
{
	struct variant_key k = key_of(args);
	uv_mutex_lock(&cache->lock);
	store_locked(cache, &k, variant, source);
	struct variant_entry *e = find_slot(cache->entries, cache->capacity, &k);
	if (e->used)
		e->uses++;
	uv_mutex_unlock(&cache->lock);
}

void variant_cache_counts(struct variant_cache *cache, uint64_t *hits, uint64_t *misses)
{
	uv_mutex_lock(&cache->lock);
	*hits = cache->hits;
	*misses = cache->misses;
	uv_mutex_unlock(&cache->lock);
}

static const char *const source_names[] = {"rule", "autotune", "file"};

int variant_cache_rows(struct variant_cache *cache, struct variant_row **rows, size_t *n)
{
	int rc = 0;
	uv_mutex_lock(&cache->lock);
	struct variant_row *grown = nc__realloc(*rows, (*n + cache->count + 1) * sizeof(**rows));
	if (!grown) {
		rc = -1;
		goto out;
	}
	*rows = grown;
	for (size_t i = 0; i < cache->capacity; i++) {
		const struct variant_entry *e = &cache->entries[i];
		if (!e->used)
			continue;
		struct variant_row *r = &grown[(*n)++];
		memset(r, 0, sizeof(*r));
		r->device = cache->device;
		r->op = (enum nk_op)e->key.op;
		r->dtype = (enum nk_dtype)e->key.dtype;
		r->weight_dtype = (enum nk_dtype)e->key.weight_dtype;
		r->flags = e->key.flags;
		r->cols = e->key.cols;
		nk_variant_name(&e->variant, r->variant, sizeof(r->variant));
		snprintf(r->source, sizeof(r->source), "%s", source_names[e->source]);
		r->uses = e->uses;
	}
out:
	uv_mutex_unlock(&cache->lock);
	return rc;
}

/* ---- persistence ---------------------------------------------------------------- */

static int parse_line(const char *line, struct variant_key *k, struct nk_variant *v)
{
	unsigned op, dtype, wdtype, flags, family, threads, rows, vec, param, source;
	long long cols;
	char extra;
	if (sscanf(line, "%u %u %u %u %lld %u %u %u %u %u %u %c", &op, &dtype, &wdtype, &flags,
		   &cols, &family, &threads, &rows, &vec, &param, &source, &extra) != 11)
		return -1;
	if (op > NK_RMSNORM_BWD || dtype > NK_BF16 || wdtype > NK_BF16 || flags > 7 ||
	    cols < 1 || family == NK_FAMILY_NONE || family > NK_FAMILY_LAST || threads == 0 ||
	    threads > 1024 || rows == 0 || rows > 65535 || vec == 0 || vec > 16)
		return -1;
	memset(k, 0, sizeof(*k));
	memset(v, 0, sizeof(*v));
	k->cols = cols;
	k->op = (uint8_t)op;
	k->dtype = (uint8_t)dtype;
	k->weight_dtype = (uint8_t)wdtype;
	k->flags = (uint8_t)flags;
	v->family = (uint16_t)family;
	v->threads = (uint16_t)threads;
	v->rows_per_block = (uint16_t)rows;
	v->vec_elems = (uint16_t)vec;
	v->param = param;
	(void)source;
	return 0;
}

static void variant_cache_load(struct variant_cache *cache)
{
	FILE *f = fopen(cache->path, "r");
	if (!f)
		return;
	char line[256], header[96];
	snprintf(header, sizeof(header), "normd-variants %d %s %d\n", VARIANT_FILE_VERSION,
		 cache->uuid_hex, NK_VARIANT_SET);
	int lineno = 1;
	bool ok = fgets(line, sizeof(line), f) && !strcmp(line, header);
	size_t loaded = 0;
	while (ok && fgets(line, sizeof(line), f)) {
		struct variant_key k;
		struct nk_variant v;
		lineno++;
		ok = parse_line(line, &k, &v) == 0;
		if (ok) {
			store_locked(cache, &k, &v, VS_FILE);
			loaded++;
		}
	}
	fclose(f);
	if (!ok) {
		log_warn("event=variant_cache_ignored path=%s line=%d reason=\"corrupt or for "
			 "another GPU or kernel version\"",
			 cache->path, lineno);
		for (size_t i = 0; i < cache->capacity; i++)
			cache->entries[i].used = false;
		cache->count = 0;
		return;
	}
	cache->dirty = false;
	log_info("event=variant_cache_loaded path=%s entries=%zu", cache->path, loaded);
}

int variant_cache_save(struct variant_cache *cache)
{
	int rc = 0;
	uv_mutex_lock(&cache->lock);
	if (!cache->path[0] || !cache->dirty)
		goto out;
	char tmp[600];
	snprintf(tmp, sizeof(tmp), "%s.tmp", cache->path);
	FILE *f = fopen(tmp, "w");
	if (!f) {
		log_warn("event=variant_cache_save_failed path=%s error=\"%s\"", tmp, strerror(errno));
		rc = -1;
		goto out;
	}
	fprintf(f, "normd-variants %d %s %d\n", VARIANT_FILE_VERSION, cache->uuid_hex,
		NK_VARIANT_SET);
	for (size_t i = 0; i < cache->capacity; i++) {
		const struct variant_entry *e = &cache->entries[i];
		if (!e->used || e->source == VS_RULE)
			continue;
		fprintf(f, "%u %u %u %u %lld %u %u %u %u %u %u\n", e->key.op, e->key.dtype,
			e->key.weight_dtype, e->key.flags, (long long)e->key.cols, e->variant.family,
			e->variant.threads, e->variant.rows_per_block, e->variant.vec_elems,
			e->variant.param, (unsigned)e->source);
	}
	if (fclose(f) != 0 || rename(tmp, cache->path) != 0) {
		log_warn("event=variant_cache_save_failed path=%s error=\"%s\"", cache->path,
			 strerror(errno));
		rc = -1;
		goto out;
	}
	cache->dirty = false;
out:
	uv_mutex_unlock(&cache->lock);
	return rc;
}

struct variant_cache *variant_cache_create(const uint8_t uuid[16], int device,
					   const char *state_dir)
{
	struct variant_cache *cache = nc__calloc(1, sizeof(*cache));
	if (!cache || uv_mutex_init(&cache->lock) != 0) {
		nc__free(cache);
		return NULL;
	}
	cache->device = device;
	for (int i = 0; i < 16; i++)
		snprintf(cache->uuid_hex + 2 * i, 3, "%02x", uuid[i]);
	if (state_dir && state_dir[0]) {
		mkdir(state_dir, 0755); /* may exist; a failure shows when saving */
		snprintf(cache->path, sizeof(cache->path), "%s/variants-%s.txt", state_dir,
			 cache->uuid_hex);
		variant_cache_load(cache);
	}
	return cache;
}

void variant_cache_destroy(struct variant_cache *cache)
{
	if (!cache)
		return;
	variant_cache_save(cache);
	uv_mutex_destroy(&cache->lock);
	nc__free(cache->entries);
	nc__free(cache);
}
