/*
 * Framing, the budgeted envelope decoder, the status mapping and the
 * allocation wrapper (see frame.h).
 */
#include "proto/frame.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

_Static_assert(NORMD__STATUS__INTERNAL == 10, "wire status table moved");
#define NC__CHECK_WIRE(name, value, text)                                                  \
	_Static_assert((value) >= 100 || (int)NORMD__STATUS__##name == (value),            \
		       "NC_STATUS_MAP and normd.proto disagree on " #name);
/* Library-only codes (>= 100) have no wire value; map them to themselves. */
#define NORMD__STATUS__IO 100
#define NORMD__STATUS__TIMEOUT 101
#define NORMD__STATUS__NOMEM 102
NC_STATUS_MAP(NC__CHECK_WIRE)
#undef NORMD__STATUS__IO
#undef NORMD__STATUS__TIMEOUT
#undef NORMD__STATUS__NOMEM

/* ---- allocation ---------------------------------------------------------- */

static _Atomic uint64_t alloc_count;
static _Atomic uint64_t alloc_fail_at;

void nc__alloc_fail_after(uint64_t n)
{
	atomic_store(&alloc_count, 0);
	atomic_store(&alloc_fail_at, n);
}

static bool alloc_should_fail(void)
{
	uint64_t fail_at = atomic_load_explicit(&alloc_fail_at, memory_order_relaxed);
	if (fail_at == 0)
		return false;
	return atomic_fetch_add(&alloc_count, 1) + 1 == fail_at;
}

void *nc__malloc(size_t size)
{
	return alloc_should_fail() ? NULL : malloc(size);
}

void *nc__calloc(size_t count, size_t size)
{
	return alloc_should_fail() ? NULL : calloc(count, size);
}

void *nc__realloc(void *ptr, size_t size)
{
	return alloc_should_fail() ? NULL : realloc(ptr, size);
}

char *nc__strdup(const char *s)
{
	size_t len = strlen(s) + 1;
	char *copy = nc__malloc(len);
	if (copy)
		memcpy(copy, s, len);
	return copy;
}

void nc__free(void *ptr)
{
	free(ptr);
}

/* ---- status names and mapping ---------------------------------------------- */

NC_API const char *nc_strerror(int status)
{
	switch (status) {
	case NC_OK:
		return "ok";
#define NC__STATUS_TEXT(name, value, text)                                                 \
	case NC_E##name:                                                                   \
		return text;
		NC_STATUS_MAP(NC__STATUS_TEXT)
#undef NC__STATUS_TEXT
	default:
		return "unknown status";
	}
}

NC_API const char *nc_status_name(int status)
{
	switch (status) {
	case NC_OK:
		return "OK";
#define NC__STATUS_NAME(name, value, text)                                                 \
	case NC_E##name:                                                                   \
		return #name;
		NC_STATUS_MAP(NC__STATUS_NAME)
#undef NC__STATUS_NAME
	default:
		return "UNKNOWN";
	}
}


int nc__status_from_wire(Normd__Status status)
{
	if ((int)status < 0 || (int)status > NORMD__STATUS__INTERNAL)
		return NC_EPROTOCOL_ERROR;
	return -(int)status;
}

Normd__Status nc__status_to_wire(int code)
{
	if (code == NC_ENOMEM)
		return NORMD__STATUS__RESOURCE_EXHAUSTED;
	if (code > 0 || -code > NORMD__STATUS__INTERNAL)
		return NORMD__STATUS__INTERNAL;
	return (Normd__Status)(-code);
}

/* ---- framing -------------------------------------------------------------- */

uint32_t nc__frame_length(const uint8_t header[NC__FRAME_HEADER_BYTES])
{
	return (uint32_t)header[0] | (uint32_t)header[1] << 8 | (uint32_t)header[2] << 16 |
	       (uint32_t)header[3] << 24;
}

int nc__frame_pack(const Normd__Envelope *env, uint32_t max_frame, uint8_t **out, size_t *len)
{
	size_t body = protobuf_c_message_get_packed_size(&env->base);
	if (body > max_frame)
		return NC_EINVALID_ARGUMENT;
	uint8_t *frame = nc__malloc(NC__FRAME_HEADER_BYTES + body);
	if (!frame)
		return NC_ENOMEM;
	frame[0] = (uint8_t)body;
	frame[1] = (uint8_t)(body >> 8);
	frame[2] = (uint8_t)(body >> 16);
	frame[3] = (uint8_t)(body >> 24);
	protobuf_c_message_pack(&env->base, frame + NC__FRAME_HEADER_BYTES);
	*out = frame;
	*len = NC__FRAME_HEADER_BYTES + body;
	return 0;
}

/* ---- budgeted unpacking ----------------------------------------------------- */

struct unpack_budget {
	size_t left;
	bool exhausted; /* an allocation was refused for the budget */
};

static void *budget_alloc(void *data, size_t size)
{
	struct unpack_budget *budget = data;
	if (budget && size > budget->left) {
		budget->exhausted = true;
		return NULL;
	}
	if (budget)
		budget->left -= size;
	return nc__malloc(size);
}

static void budget_free(void *data, void *ptr)
{
	(void)data;
	nc__free(ptr);
}

/* Frees what unpacking allocated; it needs no budget. */
static ProtobufCAllocator release_allocator = {
	.alloc = budget_alloc,
	.free = budget_free,
	.allocator_data = NULL,
};

Normd__Envelope *nc__envelope_unpack(const uint8_t *body, size_t len, const char **why)
{
	struct unpack_budget budget = {
		.left = len * NC__UNPACK_BUDGET_FACTOR + NC__UNPACK_BUDGET_SLACK,
	};
	ProtobufCAllocator allocator = {
		.alloc = budget_alloc,
		.free = budget_free,
		.allocator_data = &budget,
	};
	Normd__Envelope *env = normd__envelope__unpack(&allocator, len, body);
	if (!env) {
		if (why)
			*why = budget.exhausted ? "message too complex" : "malformed envelope";
		return NULL;
	}
	if (env->body_case == NORMD__ENVELOPE__BODY__NOT_SET) {
		if (why)
			*why = "envelope carries no message";
		nc__envelope_free(env);
		return NULL;
	}
	return env;
}

void nc__envelope_free(Normd__Envelope *env)
{
	if (env)
		protobuf_c_message_free_unpacked(&env->base, &release_allocator);
}
