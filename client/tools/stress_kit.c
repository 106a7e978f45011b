/*
 * normstress's kits: a job's memory, where it lives (host memfd regions on
 * the CPU backend, cudaMalloc allocations on the CUDA backend), how it is
 * made ready for the next job, and its check against the float64 reference
 * (stress.h).
 */
#include "client/tools/stress.h"

#include <stdio.h>
#include <string.h>

bool kit_op_is_backward(int op)
{
	return op == NC_LAYERNORM_BWD || op == NC_RMSNORM_BWD;
}

bool kit_role_is_output(int op, int role)
{
	if (op == NC_WGRAD_ACCUM)
		return role == JK_MAIN_GRAD;
	if (kit_op_is_backward(op))
		return role == JK_DX || role == JK_DGAMMA || role == JK_DBETA;
	return role == JK_Y || role == JK_MEAN || role == JK_RSTD || role == JK_RESIDUAL_OUT ||
	       role == JK_AMAX;
}

/*
 * The norm variants, each on a quarter of the jobs, where the daemon runs
 * them: residual add, a weight offset (zero-centered), FP8 output. No
 * in-place forms: a kit runs many jobs, and each would change the next one's
 * inputs.
 */
static void kit_random_variants(uint32_t features, uint64_t *rng, struct jobkit_spec *s)
{
	if (s->op == NC_WGRAD_ACCUM)
		return;
	bool forward = !kit_op_is_backward(s->op);
	if ((features & NC_FEATURE_RESIDUAL) && rng_below(rng, 4) == 0)
		s->residual = true;
	if ((features & NC_FEATURE_WEIGHT_OFFSET) && s->gamma && rng_below(rng, 4) == 0)
		s->weight_offset = 1.0f;
	if ((features & NC_FEATURE_FP8_OUTPUT) && forward && rng_below(rng, 4) == 0)
		s->y_dtype = rng_next(rng) & 1 ? NC_F8E4M3 : NC_F8E5M2;
}

static void kit_random_spec(const struct stress_opts *o, uint32_t features, uint64_t *rng,
			    struct jobkit_spec *s)
{
	memset(s, 0, sizeof(*s));
	s->op = (enum nc_op)o->ops[rng_below(rng, o->n_ops)];
	s->rows = size_pick(&o->rows, rng);
	s->cols = size_pick(&o->cols, rng);
	s->dtype = (enum nc_dtype)o->dtypes[rng_below(rng, o->n_dtypes)];
	/* Half-precision inputs get fp32 weights (apex's mixed variants) half the time. */
	if (s->dtype != NC_F32 && (rng_next(rng) & 1))
		s->weight_dtype = NC_F32;
	s->gamma = rng_below(rng, 4) != 0;
	s->beta = s->gamma && (rng_next(rng) & 1);
	/* jobkit drops the backward-only flags on forward ops. */
	s->memory_efficient = rng_next(rng) & 1;
	s->accumulate = rng_below(rng, 4) == 0;
	s->seed = rng_next(rng);
	s->on_device = o->on_device;
	s->device = o->device;
	if (s->op == NC_WGRAD_ACCUM) {
		/* The GEMM costs rows*cols*out: keep it to a few million multiply-adds. */
		s->cols = s->cols > 512 ? 1 + s->cols % 512 : s->cols;
		s->out_features = 1 + rng_below(rng, 64);
		s->accumulate = rng_next(rng) & 1; /* main_grad += (or =) */
		s->memory_efficient = false;
	}
	if (!o->on_device)
		kit_random_variants(features, rng, s);
}

int kit_create(nc_conn *conn, const struct stress_opts *o, uint64_t *rng, struct kit *k)
{
	struct jobkit_spec spec;
	kit_random_spec(o, nc_server_norm_features(conn), rng, &spec);
	memset(k, 0, sizeof(*k));
	int rc = jobkit_create(conn, &spec, &k->jk);
	if (rc)
		return rc;
	for (int role = 0; role < ROLES; role++)
		k->bytes += k->jk.bytes[role];
	return 0;
}

/* Frees the kit's region; accepts a kit that was never created. */
void kit_destroy(struct kit *k)
{
	if (k->expect)
		cudaFree(k->expect);
	jobkit_destroy(&k->jk);
	memset(k, 0, sizeof(*k));
}

/*
 * Makes a kit ready for a job whose result will be verified: accumulated
 * outputs (dgamma/dbeta, main_grad) go back to their initial values (the
 * reference starts from those) and every other output is poisoned (NaN), so
 * an output the daemon failed to write cannot pass with the previous values.
 * Other jobs just accumulate on: the client then does no GPU work of its own
 * between jobs, so the run measures the daemon, not uploads (BENCHMARKS.md).
 */
void kit_rearm(struct kit *k, bool verify, cudaStream_t stream, bool wait)
{
	struct jobkit *jk = &k->jk;
	bool copied = false;
	for (int role = 0; role < ROLES; role++) {
		if (!jk->ptr[role] || !kit_role_is_output(jk->spec.op, role))
			continue;
		if (!verify)
			continue;
		if (jk->initial[role])
			memcpy(jk->ptr[role], jk->initial[role], jk->bytes[role]);
		else
			memset(jk->ptr[role], 0xff, jk->bytes[role]);
		/* Device kits: the staging copy was reset; the device copy must be too. */
		if (jk->spec.on_device) {
			size_t offset = (size_t)((char *)jk->ptr[role] - (char *)jk->staging);
			cudaMemcpyAsync((char *)jk->device_base + offset, jk->ptr[role],
					jk->bytes[role], cudaMemcpyHostToDevice, stream);
			copied = true;
		}
	}
	/*
	 * A copy from pageable memory may return before its DMA lands: in the
	 * synchronous mode the daemon's kernel must not run first (its outputs
	 * would be overwritten); in the event mode the daemon waits for it.
	 */
	if (copied && wait)
		cudaStreamSynchronize(stream);
}

bool kit_check(const struct kit *k, struct jobkit_report *report)
{
	return jobkit_check(&k->jk, report);
}

/* "ln_bwd 37x1000 bf16/f32 gamma beta mem_eff acc +add+zero_centered" */
void kit_describe(const struct kit *k, char *buf, size_t len)
{
	const struct jobkit_spec *s = &k->jk.spec;
	const char *op = "?";
	for (size_t i = 0; i < OP_NAMES; i++) {
		if (op_names[i].value == (int)s->op) {
			op = op_names[i].name;
			break;
		}
	}
	char variants[64];
	jobkit_variant_label(s, variants, sizeof(variants));
	snprintf(buf, len, "%s %llux%llu %s/%s%s%s%s%s%s%s", op, (unsigned long long)s->rows,
		 (unsigned long long)s->cols, jobkit_dtype_name(s->dtype),
		 jobkit_dtype_name(s->weight_dtype ? s->weight_dtype : s->dtype),
		 s->gamma ? " gamma" : "", s->beta ? " beta" : "",
		 s->memory_efficient ? " mem_eff" : "", s->accumulate ? " acc" : "",
		 variants[0] ? " " : "", variants);
}
