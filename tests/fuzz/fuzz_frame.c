/*
 * libFuzzer target: the bytes a client sends, through everything that reads
 * them before a job runs.
 *
 * An input is a byte stream as it would arrive on a connection: frames of a
 * 4-byte little-endian length and an Envelope. Each frame goes through the
 * daemon's own code: nc__frame_length() against max_frame, the budgeted
 * nc__envelope_unpack(), and for a frame that does not decode,
 * nc__envelope_explain(), whose message must be one non-empty line. Decoded
 * requests then act on one connection's state as dispatch.c would:
 * RegisterRegion and UnregisterRegion change a real region table (region.c),
 * whose regions are heap buffers of exactly the registered size, and Job goes
 * through job_validate() (job.c) against that table. A job that validation
 * accepts is then run by the CPU kernels (the norm kernels, or the weight-
 * gradient GEMM): under AddressSanitizer any byte a
 * validated job could reach outside its regions is a crash, so the target
 * checks the bounds arithmetic, not just that validation returns.
 *
 * Deterministic: no sockets, no threads, no clock. Built by `make fuzz`
 * (clang, -fsanitize=fuzzer,address,undefined), seeded from tests/fuzz/corpus.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/config.h"
#include "daemon/server.h"
#include "proto/frame.h"

/* Small limits keep every accepted job cheap enough to run. */
#define FUZZ_MAX_FRAME 65536
#define FUZZ_MAX_REGIONS 16
#define FUZZ_MAX_REGION_BYTES 65536
#define FUZZ_MAX_MAPPED (4 * FUZZ_MAX_REGION_BYTES)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static struct config fuzz_config;

static const struct config *config_once(void)
{
	static bool ready;
	if (!ready) {
		config_init(&fuzz_config);
		fuzz_config.max_frame = FUZZ_MAX_FRAME;
		fuzz_config.max_regions = FUZZ_MAX_REGIONS;
		fuzz_config.max_mapped_bytes = FUZZ_MAX_MAPPED;
		ready = true;
	}
	return &fuzz_config;
}

static void region_drop(struct region *region)
{
	free(region->base);
	nc__free(region);
}

/*
 * The shape check of chunked (CUDA_VMM_FD) registrations, with as many fds
 * as chunks and with none: a refusal is INVALID_ARGUMENT with one line, and
 * what passes has 1 to NC_VMM_MAX_CHUNKS non-zero chunks adding up to size.
 */
static void fuzz_check_chunks(const Normd__RegisterRegion *msg)
{
	char why[192];
	unsigned counts[] = {(unsigned)msg->n_chunk_sizes, 0};
	for (int i = 0; i < 2; i++) {
		why[0] = '\0';
		int rc = region_check_chunks(msg, counts[i], why, sizeof(why));
		if (rc != 0 && (rc != NC_EINVALID_ARGUMENT || !why[0] || strchr(why, '\n')))
			abort();
		if (rc != 0 || msg->kind != NORMD__REGION_KIND__CUDA_VMM_FD)
			continue;
		uint64_t total = 0;
		if (msg->n_chunk_sizes == 0 || msg->n_chunk_sizes > NC_VMM_MAX_CHUNKS)
			abort();
		for (size_t c = 0; c < msg->n_chunk_sizes; c++) {
			if (msg->chunk_sizes[c] == 0)
				abort();
			total += msg->chunk_sizes[c];
		}
		if (total != msg->size)
			abort();
	}
}

/* RegisterRegion with dispatch.c's checks; memory is an exact-size heap buffer. */
static void fuzz_register(struct region_table *table, const struct config *cfg,
			  const Normd__RegisterRegion *msg)
{
	fuzz_check_chunks(msg);
	if (msg->kind != NORMD__REGION_KIND__HOST_MEMFD || msg->region_id == 0 || msg->size == 0 ||
	    msg->size > FUZZ_MAX_REGION_BYTES || region_lookup(table, msg->region_id) ||
	    table->count >= cfg->max_regions ||
	    msg->size > cfg->max_mapped_bytes - table->mapped_bytes)
		return;
	struct region *region = nc__calloc(1, sizeof(*region));
	if (!region)
		return;
	region->id = msg->region_id;
	region->kind = NORMD__REGION_KIND__HOST_MEMFD;
	region->size = msg->size;
	region->mapped_size = (size_t)msg->size;
	region->device = -1;
	region->refs = 1;
	region->base = calloc(1, (size_t)msg->size);
	if (!region->base || region_insert(table, region) != 0)
		region_drop(region);
}

static void fuzz_unregister(struct region_table *table, const Normd__UnregisterRegion *msg)
{
	struct region *region = region_remove(table, msg->region_id);
	if (region) {
		if (region->refs != 1)
			abort(); /* a job reference leaked */
		region_drop(region);
	}
}

static void fuzz_job(struct region_table *table, const struct config *cfg, const Normd__Job *msg)
{
	struct job *job = calloc(1, sizeof(*job));
	if (!job)
		return;
	if (job_validate(job, table, cfg, msg) == 0) {
		struct nk_cpu_opts opts = {.precision = NK_CPU_FP32, .threads = 1};
		struct nk_norm_result result;
		int rc = job->wgrad ? nk_cpu_wgrad(&job->gemm, &opts)
				    : nk_cpu_norm(&job->args, &opts, &result);
		if (rc == NK_EINVAL)
			abort(); /* validation let through what the kernels refuse */
	} else if (job->status == 0 || !job->message[0] || strchr(job->message, '\n')) {
		abort(); /* every refusal has a status and a one-line message */
	}
	/* Give back the references validation took, as job_free() does. */
	for (unsigned i = 0; i < job->region_count; i++)
		job->regions[i]->refs--;
	free(job);
}

static void fuzz_dispatch(struct region_table *table, const struct config *cfg,
			  const Normd__Envelope *env)
{
	switch (env->body_case) {
	case NORMD__ENVELOPE__BODY_REGISTER_REGION:
		fuzz_register(table, cfg, env->register_region);
		break;
	case NORMD__ENVELOPE__BODY_UNREGISTER_REGION:
		fuzz_unregister(table, env->unregister_region);
		break;
	case NORMD__ENVELOPE__BODY_JOB:
		fuzz_job(table, cfg, env->job);
		break;
	default:
		break;
	}
}

static void table_free(struct region_table *table)
{
	for (size_t i = 0; i < table->capacity; i++) {
		if (table->slots[i])
			region_drop(table->slots[i]);
	}
	nc__free(table->slots);
	region_table_init(table);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	const struct config *cfg = config_once();
	struct region_table table;
	region_table_init(&table);
	size_t pos = 0;
	while (size - pos >= NC__FRAME_HEADER_BYTES) {
		uint32_t len = nc__frame_length(data + pos);
		pos += NC__FRAME_HEADER_BYTES;
		if (len > cfg->max_frame || len > size - pos)
			break; /* the daemon closes, or waits for the rest */
		const char *why = NULL;
		Normd__Envelope *env = nc__envelope_unpack(data + pos, len, &why);
		if (!env) {
			char explain[160];
			nc__envelope_explain(data + pos, len, explain, sizeof(explain));
			if (!why || !explain[0] || strchr(explain, '\n'))
				abort();
			break; /* the daemon answers and closes */
		}
		pos += len;
		fuzz_dispatch(&table, cfg, env);
		nc__envelope_free(env);
	}
	table_free(&table);
	return 0;
}
