/*
 * Writes the seed corpus of tests/fuzz/fuzz_frame.c: byte streams as a
 * client would send them, one file each. Every message type of
 * proto/normd.proto appears in a valid frame; sessions register a region and
 * run valid jobs of every op, dtype and flag, so the fuzzer starts from
 * inputs that reach the deepest checks; a few known-bad frames follow.
 *
 *   make fuzz-corpus     (runs build/tests/fuzz/gen_corpus tests/fuzz/corpus)
 *
 * The output is deterministic; the files are committed.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/frame.h"

#define REGION_ID 1
#define REGION_BYTES 65536

struct stream {
	uint8_t bytes[16384];
	size_t len;
	uint64_t next_id;
};

static void add(struct stream *s, Normd__Envelope *env)
{
	uint8_t *frame;
	size_t len;
	env->has_request_id = true;
	env->request_id = ++s->next_id;
	if (nc__frame_pack(env, UINT32_MAX, &frame, &len) || len > sizeof(s->bytes) - s->len) {
		fprintf(stderr, "gen_corpus: frame does not fit\n");
		exit(1);
	}
	memcpy(s->bytes + s->len, frame, len);
	s->len += len;
	nc__free(frame);
}

static void add_raw(struct stream *s, const uint8_t *bytes, size_t len)
{
	memcpy(s->bytes + s->len, bytes, len);
	s->len += len;
}

static const char *out_dir;

static void save(const char *name, const struct stream *s)
{
	char path[4096];
	snprintf(path, sizeof(path), "%s/%s", out_dir, name);
	FILE *f = fopen(path, "wb");
	if (!f || fwrite(s->bytes, 1, s->len, f) != s->len || fclose(f) != 0) {
		fprintf(stderr, "gen_corpus: %s: %s\n", path, strerror(errno));
		exit(1);
	}
}

static void add_hello(struct stream *s)
{
	Normd__Hello hello = NORMD__HELLO__INIT;
	hello.protocol_version = NORMD__PROTOCOL_VERSION__PROTOCOL_VERSION;
	hello.client_name = "corpus";
	hello.has_pid = true;
	hello.pid = 4242;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.body_case = NORMD__ENVELOPE__BODY_HELLO;
	env.hello = &hello;
	add(s, &env);
}

static void add_register(struct stream *s, uint64_t id, uint64_t size)
{
	Normd__RegisterRegion reg = NORMD__REGISTER_REGION__INIT;
	reg.region_id = id;
	reg.kind = NORMD__REGION_KIND__HOST_MEMFD;
	reg.size = size;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.body_case = NORMD__ENVELOPE__BODY_REGISTER_REGION;
	env.register_region = &reg;
	add(s, &env);
}

static void add_unregister(struct stream *s, uint64_t id)
{
	Normd__UnregisterRegion unreg = NORMD__UNREGISTER_REGION__INIT;
	unreg.region_id = id;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.body_case = NORMD__ENVELOPE__BODY_UNREGISTER_REGION;
	env.unregister_region = &unreg;
	add(s, &env);
}

/* A valid job of `op` on REGION_ID: every tensor the op may use, laid out apart. */
static void add_job(struct stream *s, Normd__Op op, Normd__DType dtype, Normd__DType weight,
		    bool memory_efficient, bool accumulate)
{
	enum { ROWS = 4, COLS = 64 };
	bool backward = op == NORMD__OP__LAYERNORM_BWD || op == NORMD__OP__RMSNORM_BWD;
	bool layer = op == NORMD__OP__LAYERNORM_FWD || op == NORMD__OP__LAYERNORM_BWD;
	Normd__Tensor t[10];
	Normd__Tensor *slot[10] = {0};
	for (int i = 0; i < 10; i++) {
		normd__tensor__init(&t[i]);
		t[i].region_id = REGION_ID;
		t[i].has_offset = true;
		t[i].offset = (uint64_t)i * ROWS * COLS * 4;
	}
	/* x, y, mean, rstd, gamma, beta, dy, dx, dgamma, dbeta */
	slot[0] = &t[0];
	slot[3] = &t[3];
	slot[4] = &t[4];
	if (layer)
		slot[5] = &t[5];
	if (!backward) {
		slot[1] = &t[1];
		if (layer)
			slot[2] = &t[2];
	} else {
		slot[6] = &t[6];
		slot[7] = &t[7];
		slot[8] = &t[8];
		if (layer) {
			slot[9] = &t[9];
			if (!memory_efficient)
				slot[2] = &t[2];
		}
	}
	Normd__Job job = NORMD__JOB__INIT;
	job.op = op;
	job.rows = ROWS;
	job.cols = COLS;
	job.has_eps = true;
	job.eps = 1e-5f;
	job.dtype = dtype;
	if (weight != dtype) {
		job.has_weight_dtype = true;
		job.weight_dtype = weight;
	}
	job.has_memory_efficient = job.has_accumulate = true;
	job.memory_efficient = memory_efficient;
	job.accumulate = accumulate;
	job.has_deadline_us = true;
	job.deadline_us = 1000000;
	job.x = slot[0], job.y = slot[1], job.mean = slot[2], job.rstd = slot[3];
	job.gamma = slot[4], job.beta = slot[5], job.dy = slot[6], job.dx = slot[7];
	job.dgamma = slot[8], job.dbeta = slot[9];
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.body_case = NORMD__ENVELOPE__BODY_JOB;
	env.job = &job;
	add(s, &env);
}

static void session_seeds(void)
{
	static const Normd__Op ops[] = {NORMD__OP__LAYERNORM_FWD, NORMD__OP__RMSNORM_FWD,
					NORMD__OP__LAYERNORM_BWD, NORMD__OP__RMSNORM_BWD};
	static const char *const op_names[] = {"ln_fwd", "rms_fwd", "ln_bwd", "rms_bwd"};
	static const struct {
		Normd__DType dtype, weight;
		const char *name;
	} types[] = {
		{NORMD__DTYPE__F32, NORMD__DTYPE__F32, "f32"},
		{NORMD__DTYPE__F16, NORMD__DTYPE__F16, "f16"},
		{NORMD__DTYPE__BF16, NORMD__DTYPE__BF16, "bf16"},
		{NORMD__DTYPE__BF16, NORMD__DTYPE__F32, "bf16_f32"},
	};
	for (size_t o = 0; o < 4; o++) {
		bool backward = ops[o] == NORMD__OP__LAYERNORM_BWD || ops[o] == NORMD__OP__RMSNORM_BWD;
		for (size_t t = 0; t < 4; t++) {
			for (int flags = 0; flags < (backward ? 3 : 1); flags++) {
				struct stream s = {0};
				char name[64];
				add_hello(&s);
				add_register(&s, REGION_ID, REGION_BYTES);
				add_job(&s, ops[o], types[t].dtype, types[t].weight, flags == 1,
					flags == 2);
				add_unregister(&s, REGION_ID);
				snprintf(name, sizeof(name), "session_%s_%s%s", op_names[o],
					 types[t].name,
					 flags == 1 ? "_memeff" : flags == 2 ? "_accumulate" : "");
				save(name, &s);
			}
		}
	}
}

/* WGRAD_ACCUM: main_grad[out, in] (+)= dy^T x, overwriting and accumulating. */
static void wgrad_seeds(void)
{
	enum { TOKENS = 8, IN = 16, OUT = 4 };
	for (uint32_t beta = 0; beta <= 1; beta++) {
		struct stream s = {0};
		add_hello(&s);
		add_register(&s, REGION_ID, REGION_BYTES);
		Normd__Tensor x = NORMD__TENSOR__INIT, dy = NORMD__TENSOR__INIT;
		Normd__Tensor grad = NORMD__TENSOR__INIT;
		x.region_id = dy.region_id = grad.region_id = REGION_ID;
		dy.has_offset = grad.has_offset = true;
		dy.offset = TOKENS * IN * 4;
		grad.offset = dy.offset + TOKENS * OUT * 4;
		Normd__Job job = NORMD__JOB__INIT;
		job.op = NORMD__OP__WGRAD_ACCUM;
		job.rows = TOKENS;
		job.cols = IN;
		job.dtype = beta ? NORMD__DTYPE__BF16 : NORMD__DTYPE__F32;
		job.has_out_features = job.has_gemm_beta = true;
		job.out_features = OUT;
		job.gemm_beta = beta;
		job.x = &x;
		job.dy = &dy;
		job.main_grad = &grad;
		Normd__Envelope env = NORMD__ENVELOPE__INIT;
		env.body_case = NORMD__ENVELOPE__BODY_JOB;
		env.job = &job;
		add(&s, &env);
		save(beta ? "session_wgrad_bf16_accumulate" : "session_wgrad_f32", &s);
	}
}

/*
 * Protocol 3's norm variants: a residual-add forward with a zero-centered
 * weight and FP8 output, vLLM's in-place form, a backward with ds, and a
 * forward whose y overlaps x partially (refused).
 */
static void variant_seeds(void)
{
	enum { ROWS = 4, COLS = 64, ROW_BYTES = ROWS * COLS * 4 };
	for (int k = 0; k < 4; k++) {
		static const char *const names[] = {"variant_add_zc_fp8", "variant_in_place",
						    "variant_bwd_ds", "variant_partial_alias"};
		struct stream s = {0};
		add_hello(&s);
		add_register(&s, REGION_ID, REGION_BYTES);
		Normd__Tensor t[8];
		for (int i = 0; i < 8; i++) {
			normd__tensor__init(&t[i]);
			t[i].region_id = REGION_ID;
			t[i].has_offset = true;
			t[i].offset = (uint64_t)i * ROW_BYTES;
		}
		Normd__Job job = NORMD__JOB__INIT;
		job.op = k == 2 ? NORMD__OP__RMSNORM_BWD : NORMD__OP__RMSNORM_FWD;
		job.rows = ROWS;
		job.cols = COLS;
		job.dtype = NORMD__DTYPE__BF16;
		job.x = &t[0];
		job.gamma = &t[1];
		job.rstd = &t[2];
		if (k == 2) {
			job.dy = &t[3];
			job.dx = &t[4];
			job.ds = &t[5];
		} else {
			job.y = k == 1 ? &t[0] : &t[3];
			job.residual = &t[5];
			job.residual_out = k == 1 ? &t[5] : &t[6];
		}
		if (k == 0) {
			job.has_weight_offset = job.has_y_dtype = true;
			job.weight_offset = 1.0f;
			job.y_dtype = NORMD__DTYPE__F8E4M3;
			job.scale = &t[7];
			t[4].offset = 7 * ROW_BYTES + 64;
			job.amax = &t[4];
		}
		if (k == 3)
			t[3].offset = 2; /* y two bytes into x */
		Normd__Envelope env = NORMD__ENVELOPE__INIT;
		env.body_case = NORMD__ENVELOPE__BODY_JOB;
		env.job = &job;
		add(&s, &env);
		save(names[k], &s);
	}
}

/* One valid frame of every message type, daemon-to-client ones included. */
static void message_seeds(void)
{
	struct stream s = {0};
	add_hello(&s);
	save("msg_hello", &s);

	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	Normd__Limits limits = NORMD__LIMITS__INIT;
	limits.has_max_frame = true;
	limits.max_frame = 65536;
	Normd__Device device = NORMD__DEVICE__INIT;
	device.index = -1;
	device.name = "host";
	Normd__Device *devices[] = {&device};
	Normd__HelloReply hello_reply = NORMD__HELLO_REPLY__INIT;
	hello_reply.server_version = "0.1.0";
	hello_reply.n_devices = 1;
	hello_reply.devices = devices;
	hello_reply.limits = &limits;
	env.body_case = NORMD__ENVELOPE__BODY_HELLO_REPLY;
	env.hello_reply = &hello_reply;
	s.len = 0;
	add(&s, &env);
	save("msg_hello_reply", &s);

	s.len = 0;
	add_hello(&s);
	add_register(&s, 7, 4096);
	save("msg_register_region", &s);
	add_unregister(&s, 7);
	save("msg_unregister_region", &s);

	Normd__Result result = NORMD__RESULT__INIT;
	result.status = NORMD__STATUS__INVALID_ARGUMENT;
	result.message = "a refusal";
	env.body_case = NORMD__ENVELOPE__BODY_RESULT;
	env.result = &result;
	s.len = 0;
	add(&s, &env);
	save("msg_result", &s);

	Normd__JobReply job_reply = NORMD__JOB_REPLY__INIT;
	job_reply.variant = "cpu/fp32/t1";
	job_reply.has_device_us = true;
	job_reply.device_us = 12;
	env.body_case = NORMD__ENVELOPE__BODY_JOB_REPLY;
	env.job_reply = &job_reply;
	s.len = 0;
	add(&s, &env);
	save("msg_job_reply", &s);

	uint64_t counts[16] = {3, 0, 1, 0, 0, 2};
	Normd__StatsReply stats_reply = NORMD__STATS_REPLY__INIT;
	stats_reply.n_errors_by_status = 11;
	stats_reply.errors_by_status = counts;
	stats_reply.n_rejections = 16;
	stats_reply.rejections = counts;
	stats_reply.backend = "cpu";
	env.body_case = NORMD__ENVELOPE__BODY_STATS_REPLY;
	env.stats_reply = &stats_reply;
	s.len = 0;
	add(&s, &env);
	save("msg_stats_reply", &s);

	Normd__StatsRequest stats = NORMD__STATS_REQUEST__INIT;
	Normd__Ping ping = NORMD__PING__INIT;
	ping.has_nonce = true;
	ping.nonce = 99;
	Normd__Pong pong = NORMD__PONG__INIT;
	Normd__Goodbye goodbye = NORMD__GOODBYE__INIT;
	Normd__GoAway go_away = NORMD__GO_AWAY__INIT;
	go_away.status = NORMD__STATUS__SHUTTING_DOWN;
	s.len = 0;
	add_hello(&s);
	env.body_case = NORMD__ENVELOPE__BODY_STATS;
	env.stats = &stats;
	add(&s, &env);
	env.body_case = NORMD__ENVELOPE__BODY_PING;
	env.ping = &ping;
	add(&s, &env);
	env.body_case = NORMD__ENVELOPE__BODY_PONG;
	env.pong = &pong;
	add(&s, &env);
	env.body_case = NORMD__ENVELOPE__BODY_GO_AWAY;
	env.go_away = &go_away;
	add(&s, &env);
	Normd__VariantsRequest variants = NORMD__VARIANTS_REQUEST__INIT;
	env.body_case = NORMD__ENVELOPE__BODY_VARIANTS;
	env.variants = &variants;
	add(&s, &env);
	env.body_case = NORMD__ENVELOPE__BODY_GOODBYE;
	env.goodbye = &goodbye;
	add(&s, &env);
	save("msg_stats_ping_pong_goaway_variants_goodbye", &s);

	Normd__VariantEntry entry = NORMD__VARIANT_ENTRY__INIT;
	entry.variant = "warp_rows/v8";
	Normd__VariantEntry *entries[] = {&entry};
	Normd__VariantsReply variants_reply = NORMD__VARIANTS_REPLY__INIT;
	variants_reply.n_entries = 1;
	variants_reply.entries = entries;
	env.body_case = NORMD__ENVELOPE__BODY_VARIANTS_REPLY;
	env.variants_reply = &variants_reply;
	s.len = 0;
	add(&s, &env);
	save("msg_variants_reply", &s);
}

/* Frames the daemon must refuse. */
static void bad_seeds(void)
{
	struct stream s = {0};
	/* Job {op, cols, dtype}: no rows. */
	static const uint8_t no_rows[] = {10, 0, 0, 0, 0x08, 0x02, 0x7a, 0x06,
					  0x08, 0x01, 0x18, 0x40, 0x28, 0x01};
	add_hello(&s);
	add_raw(&s, no_rows, sizeof(no_rows));
	save("bad_missing_field", &s);
	/* A length prefix far over max_frame. */
	static const uint8_t huge[] = {0x00, 0x00, 0x00, 0x40, 0x08, 0x01};
	s.len = 0;
	add_hello(&s);
	add_raw(&s, huge, sizeof(huge));
	save("bad_frame_too_large", &s);
	/* Offsets near 2^64 and a shape whose size wraps. */
	s.len = 0;
	add_hello(&s);
	add_register(&s, REGION_ID, REGION_BYTES);
	Normd__Tensor x = NORMD__TENSOR__INIT, y = NORMD__TENSOR__INIT;
	x.region_id = y.region_id = REGION_ID;
	x.has_offset = true;
	x.offset = UINT64_MAX - 7;
	Normd__Job job = NORMD__JOB__INIT;
	job.op = NORMD__OP__LAYERNORM_FWD;
	job.rows = (1ull << 40) + 1;
	job.cols = 1ull << 24;
	job.dtype = NORMD__DTYPE__F32;
	job.x = &x;
	job.y = &y;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.body_case = NORMD__ENVELOPE__BODY_JOB;
	env.job = &job;
	add(&s, &env);
	job.rows = 4;
	job.cols = 64;
	add(&s, &env);
	save("bad_overflow", &s);
}

/*
 * CUDA_VMM_FD registrations (no fds travel in a corpus): a well-formed one
 * of three chunks, and ones with a zero chunk and a wrong sum.
 */
static void vmm_seeds(void)
{
	static const uint64_t good[] = {2u << 20, 2u << 20, 20u << 20};
	static const uint64_t zero[] = {2u << 20, 0};
	static const struct {
		const char *name;
		const uint64_t *sizes;
		size_t count;
		uint64_t size;
	} seeds[] = {
		{"register_vmm_three_chunks", good, 3, 24u << 20},
		{"register_vmm_zero_chunk", zero, 2, 2u << 20},
		{"register_vmm_bad_sum", good, 3, 4096},
	};
	for (size_t i = 0; i < sizeof(seeds) / sizeof(seeds[0]); i++) {
		struct stream s = {0};
		add_hello(&s);
		Normd__RegisterRegion reg = NORMD__REGISTER_REGION__INIT;
		reg.region_id = REGION_ID;
		reg.kind = NORMD__REGION_KIND__CUDA_VMM_FD;
		reg.has_device = true;
		reg.size = seeds[i].size;
		reg.n_chunk_sizes = seeds[i].count;
		reg.chunk_sizes = (uint64_t *)seeds[i].sizes;
		Normd__Envelope env = NORMD__ENVELOPE__INIT;
		env.body_case = NORMD__ENVELOPE__BODY_REGISTER_REGION;
		env.register_region = &reg;
		add(&s, &env);
		save(seeds[i].name, &s);
	}
}

int main(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: gen_corpus DIR\n");
		return 2;
	}
	out_dir = argv[1];
	session_seeds();
	wgrad_seeds();
	variant_seeds();
	vmm_seeds();
	message_seeds();
	bad_seeds();
	return 0;
}
