/*
 * Framing, the budgeted envelope decoder, the status mapping and the
 * allocation wrapper (see frame.h).
 */
#include "proto/frame.h"

#include <stdatomic.h>
#include <stdio.h>
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
#define NORMD__STATUS__DISCONNECTED 103
NC_STATUS_MAP(NC__CHECK_WIRE)
#undef NORMD__STATUS__DISCONNECTED
#undef NORMD__STATUS__IO
#undef NORMD__STATUS__TIMEOUT
#undef NORMD__STATUS__NOMEM

#define NC__CHECK_REJECT(name, value, text)                                                \
	_Static_assert((int)NORMD__REJECT_REASON__REJECT_##name == (value),                \
		       "NC_REJECT_MAP and normd.proto disagree on " #name);
NC_REJECT_MAP(NC__CHECK_REJECT)
#undef NC__CHECK_REJECT
_Static_assert(NC_REJECT_COUNT <= 32, "nc_stats.rejections is too small");

/* ---- allocation ---------------------------------------------------------- */

static _Atomic uint64_t alloc_count;
static _Atomic uint64_t alloc_fail_at;
static void (*alloc_fail_hook)(uint64_t n);

void nc__alloc_fail_after(uint64_t n, void (*on_fail)(uint64_t n))
{
	atomic_store(&alloc_count, 0);
	alloc_fail_hook = on_fail;
	atomic_store(&alloc_fail_at, n);
}

static bool alloc_should_fail(void)
{
	uint64_t fail_at = atomic_load_explicit(&alloc_fail_at, memory_order_acquire);
	if (fail_at == 0 || atomic_fetch_add(&alloc_count, 1) + 1 != fail_at)
		return false;
	if (alloc_fail_hook)
		alloc_fail_hook(fail_at);
	return true;
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

/*
 * nc_status_name() is here rather than in client/lib/status.c with
 * nc_strerror() because the daemon logs refusals with it (daemon/reply.c)
 * and links this file, not the library.
 */
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

void nc__frame_pack_into(const Normd__Envelope *env, size_t body, uint8_t *out)
{
	out[0] = (uint8_t)body;
	out[1] = (uint8_t)(body >> 8);
	out[2] = (uint8_t)(body >> 16);
	out[3] = (uint8_t)(body >> 24);
	protobuf_c_message_pack(&env->base, out + NC__FRAME_HEADER_BYTES);
}

int nc__frame_pack(const Normd__Envelope *env, uint32_t max_frame, uint8_t **out, size_t *len)
{
	size_t body = protobuf_c_message_get_packed_size(&env->base);
	if (body > max_frame)
		return NC_EINVALID_ARGUMENT;
	uint8_t *frame = nc__malloc(NC__FRAME_HEADER_BYTES + body);
	if (!frame)
		return NC_ENOMEM;
	nc__frame_pack_into(env, body, frame);
	*out = frame;
	*len = NC__FRAME_HEADER_BYTES + body;
	return 0;
}

/* ---- budgeted unpacking ----------------------------------------------------- */

struct unpack_budget {
	size_t left;
	bool exhausted; /* an allocation was refused for the budget */
	bool no_memory; /* an allocation within the budget failed */
	struct nc__unpack_arena *arena; /* drawn from first; may be NULL */
};

/* Arena allocations keep malloc's alignment. */
#define ARENA_ALIGN 16u

static bool arena_owns(const struct nc__unpack_arena *arena, const void *ptr)
{
	const unsigned char *p = ptr;
	return arena && p >= arena->bytes && p < arena->bytes + arena->cap;
}

static void *budget_alloc(void *data, size_t size)
{
	struct unpack_budget *budget = data;
	if (budget && size > budget->left) {
		budget->exhausted = true;
		return NULL;
	}
	if (budget)
		budget->left -= size;
	struct nc__unpack_arena *arena = budget ? budget->arena : NULL;
	size_t rounded = (size + ARENA_ALIGN - 1) & ~(size_t)(ARENA_ALIGN - 1);
	if (arena && rounded >= size && arena->cap - arena->used >= rounded) {
		void *ptr = arena->bytes + arena->used;
		arena->used += rounded;
		return ptr;
	}
	void *ptr = nc__malloc(size);
	if (!ptr && budget)
		budget->no_memory = true;
	return ptr;
}

static void budget_free(void *data, void *ptr)
{
	const struct unpack_budget *budget = data;
	if (!arena_owns(budget ? budget->arena : NULL, ptr))
		nc__free(ptr);
}

Normd__Envelope *nc__envelope_unpack_arena(const uint8_t *body, size_t len,
					   struct nc__unpack_arena *arena, const char **why)
{
	struct unpack_budget budget = {
		.left = len * NC__UNPACK_BUDGET_FACTOR + NC__UNPACK_BUDGET_SLACK,
		.arena = arena,
	};
	ProtobufCAllocator allocator = {
		.alloc = budget_alloc,
		.free = budget_free,
		.allocator_data = &budget,
	};
	if (arena)
		arena->used = 0;
	Normd__Envelope *env = normd__envelope__unpack(&allocator, len, body);
	if (!env) {
		if (why)
			*why = budget.no_memory	  ? NC__WHY_NO_MEMORY
			       : budget.exhausted ? "message too complex"
						  : "malformed envelope";
		return NULL;
	}
	if (env->body_case == NORMD__ENVELOPE__BODY__NOT_SET) {
		if (why)
			*why = "envelope carries no message";
		nc__envelope_free_arena(env, arena);
		return NULL;
	}
	return env;
}

Normd__Envelope *nc__envelope_unpack(const uint8_t *body, size_t len, const char **why)
{
	return nc__envelope_unpack_arena(body, len, NULL, why);
}

void nc__envelope_free_arena(Normd__Envelope *env, struct nc__unpack_arena *arena)
{
	/* Freeing needs no budget, only the arena, whose blocks stay where they are. */
	struct unpack_budget budget = {.arena = arena};
	ProtobufCAllocator allocator = {
		.alloc = budget_alloc,
		.free = budget_free,
		.allocator_data = &budget,
	};
	if (env)
		protobuf_c_message_free_unpacked(&env->base, &allocator);
	if (arena)
		arena->used = 0;
}

void nc__envelope_free(Normd__Envelope *env)
{
	nc__envelope_free_arena(env, NULL);
}

/* ---- explaining a frame that does not decode ----------------------------------- */

#define EXPLAIN_MAX_DEPTH 8
#define EXPLAIN_MAX_FIELDS 64

/* Reads one varint at *pos; false if it is truncated or longer than 10 bytes. */
static bool wire_varint(const uint8_t *p, size_t len, size_t *pos, uint64_t *out)
{
	uint64_t v = 0;
	for (unsigned shift = 0; shift < 70 && *pos < len; shift += 7) {
		uint8_t byte = p[(*pos)++];
		if (shift < 64)
			v |= (uint64_t)(byte & 0x7f) << shift;
		if (!(byte & 0x80)) {
			*out = v;
			return true;
		}
	}
	return false;
}

/* The wire type protobuf uses for a field type (packed repeated fields also take 2). */
static unsigned wire_type_of(ProtobufCType type)
{
	switch (type) {
	case PROTOBUF_C_TYPE_SFIXED32:
	case PROTOBUF_C_TYPE_FIXED32:
	case PROTOBUF_C_TYPE_FLOAT:
		return 5;
	case PROTOBUF_C_TYPE_SFIXED64:
	case PROTOBUF_C_TYPE_FIXED64:
	case PROTOBUF_C_TYPE_DOUBLE:
		return 1;
	case PROTOBUF_C_TYPE_STRING:
	case PROTOBUF_C_TYPE_BYTES:
	case PROTOBUF_C_TYPE_MESSAGE:
		return 2;
	default:
		return 0;
	}
}

/* Skips one field's payload of wire type `wt`; false if it runs past the end. */
static bool wire_skip(const uint8_t *p, size_t len, size_t *pos, unsigned wt, size_t *sub_len)
{
	uint64_t v;
	*sub_len = 0;
	switch (wt) {
	case 0:
		return wire_varint(p, len, pos, &v);
	case 1:
	case 5: {
		size_t n = wt == 1 ? 8 : 4;
		if (len - *pos < n)
			return false;
		*pos += n;
		return true;
	}
	case 2:
		if (!wire_varint(p, len, pos, &v) || v > len - *pos)
			return false;
		*sub_len = (size_t)v;
		*pos += (size_t)v;
		return true;
	default:
		return false; /* groups (3, 4) are not part of this protocol; 6, 7 do not exist */
	}
}

/*
 * Walks one message with its descriptor and writes the first problem found
 * into buf: malformed wire data, a field with the wrong wire type, a missing
 * required field, recursively into sub-messages. Returns true if it found one.
 */
static bool explain_message(const ProtobufCMessageDescriptor *desc, const uint8_t *p, size_t len,
			    const char *path, int depth, char *buf, size_t buf_len)
{
	bool seen[EXPLAIN_MAX_FIELDS] = {false};
	size_t pos = 0;
	while (pos < len) {
		size_t start = pos, sub_len;
		uint64_t key;
		if (!wire_varint(p, len, &pos, &key)) {
			snprintf(buf, buf_len, "%s: truncated field key at byte %zu", path, start);
			return true;
		}
		uint64_t tag = key >> 3;
		unsigned wt = (unsigned)(key & 7);
		if (tag == 0 || tag > 536870911u) {
			snprintf(buf, buf_len, "%s: invalid field number %llu at byte %zu", path,
				 (unsigned long long)tag, start);
			return true;
		}
		const ProtobufCFieldDescriptor *f =
			protobuf_c_message_descriptor_get_field(desc, (unsigned)tag);
		if (!wire_skip(p, len, &pos, wt, &sub_len)) {
			if (f)
				snprintf(buf, buf_len, "%s.%s (wire type %u) is cut short or malformed "
					 "at byte %zu", path, f->name, wt, start);
			else
				snprintf(buf, buf_len, "%s: field %llu (wire type %u) is cut short or "
					 "malformed at byte %zu", path, (unsigned long long)tag, wt, start);
			return true;
		}
		if (!f)
			continue; /* unknown fields are kept, not refused */
		unsigned want = wire_type_of(f->type);
		bool packed = f->label == PROTOBUF_C_LABEL_REPEATED && wt == 2 && want != 2;
		if (wt != want && !packed) {
			snprintf(buf, buf_len, "%s.%s has wire type %u, expected %u", path, f->name,
				 wt, want);
			return true;
		}
		size_t index = (size_t)(f - desc->fields);
		if (index < EXPLAIN_MAX_FIELDS)
			seen[index] = true;
		if (f->type == PROTOBUF_C_TYPE_MESSAGE && depth < EXPLAIN_MAX_DEPTH) {
			char sub_path[128];
			const ProtobufCMessageDescriptor *sub = f->descriptor;
			/* The body of an Envelope is named by its type; deeper fields by name. */
			if (depth == 0)
				snprintf(sub_path, sizeof(sub_path), "%s", sub->short_name);
			else
				snprintf(sub_path, sizeof(sub_path), "%s.%s", path, f->name);
			if (explain_message(sub, p + pos - sub_len, sub_len, sub_path, depth + 1, buf,
					    buf_len))
				return true;
		}
	}
	for (unsigned i = 0; i < desc->n_fields && i < EXPLAIN_MAX_FIELDS; i++) {
		if (desc->fields[i].label == PROTOBUF_C_LABEL_REQUIRED && !seen[i]) {
			snprintf(buf, buf_len, "%s is missing required field '%s'", path,
				 desc->fields[i].name);
			return true;
		}
	}
	return false;
}

void nc__envelope_explain(const uint8_t *body, size_t len, char *buf, size_t buf_len)
{
	if (!explain_message(&normd__envelope__descriptor, body, len, "Envelope", 0, buf, buf_len))
		snprintf(buf, buf_len, "malformed envelope");
}
