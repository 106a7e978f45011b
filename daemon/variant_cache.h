/*
 * The kernel-variant cache of one CUDA device: (op, dtypes, cols, flags) ->
 * the variant and launch shape that runs such jobs fastest. Filled by the
 * kernels' rules on first use (or by autotuning in backend_cuda.c),
 * persisted per GPU under the state directory as a small text file, and
 * reloaded at start; a corrupt or foreign file is ignored with a warning.
 * Safe to use from the device's worker threads and the loop at once.
 */
#ifndef NORMD_VARIANT_CACHE_H
#define NORMD_VARIANT_CACHE_H

#include <stdbool.h>
#include <stdint.h>

#include "daemon/server.h"
#include "kernels/norm_kernels.h"

enum variant_key_flags {
	VK_MEMORY_EFFICIENT = 1u << 0,
	VK_GAMMA = 1u << 1,
	VK_BETA = 1u << 2,
};

enum variant_source { VS_RULE = 0, VS_AUTOTUNE = 1, VS_FILE = 2 };

struct variant_cache;

/* A cache for the device with this UUID; loads `state_dir`'s file if it has one. */
struct variant_cache *variant_cache_create(const uint8_t uuid[16], int device,
					   const char *state_dir);
void variant_cache_destroy(struct variant_cache *cache);

/* Looks the job's key up; true (and *out) on a hit. Counts hits and misses. */
bool variant_cache_lookup(struct variant_cache *cache, const struct nk_norm_args *args,
			  struct nk_variant *out);
/* Stores a variant for the job's key (replacing any). */
void variant_cache_store(struct variant_cache *cache, const struct nk_norm_args *args,
			 const struct nk_variant *variant, enum variant_source source);
/* Writes the table to the state directory (atomically); 0 or -1 (logged). */
int variant_cache_save(struct variant_cache *cache);
/* Appends the table's rows to *rows (nc__realloc'ed), counting in *n. */
int variant_cache_rows(struct variant_cache *cache, struct variant_row **rows, size_t *n);
void variant_cache_counts(struct variant_cache *cache, uint64_t *hits, uint64_t *misses);

#endif /* NORMD_VARIANT_CACHE_H */
