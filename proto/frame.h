/*
 * Framing and message codec shared by the daemon and the client library:
 * the only code that turns raw bytes into messages.
 *
 * A frame is a 4-byte little-endian body length followed by one
 * normd.Envelope. The length is checked against a limit before anything is
 * allocated, and unpacking draws from a byte budget, so a peer can make us
 * allocate at most a small multiple of the frame it sent.
 */
#ifndef NORMD_FRAME_H
#define NORMD_FRAME_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "normd.pb-c.h"
#include "normclient.h"

#define NC__FRAME_HEADER_BYTES 4u
#define NC__DEFAULT_MAX_FRAME (64u * 1024u)
/* Unpacking may allocate at most this many times the frame's size (+ slack). */
#define NC__UNPACK_BUDGET_FACTOR 8u
#define NC__UNPACK_BUDGET_SLACK 4096u

/* The body length a header announces. */
uint32_t nc__frame_length(const uint8_t header[NC__FRAME_HEADER_BYTES]);

/*
 * Packs `env` into a new frame (header + body) of *len bytes in *out, which
 * the caller frees with nc__free(). Returns 0, NC_ENOMEM, or
 * NC_EINVALID_ARGUMENT if the body would exceed `max_frame`.
 */
int nc__frame_pack(const Normd__Envelope *env, uint32_t max_frame, uint8_t **out, size_t *len);
/*
 * Packs `env`, whose body is `body` bytes (protobuf_c_message_get_packed_size),
 * as a frame into `out`, which has room for NC__FRAME_HEADER_BYTES + body.
 */
void nc__frame_pack_into(const Normd__Envelope *env, size_t body, uint8_t *out);

/*
 * Unpacks one body. Returns NULL if the bytes are not a valid Envelope, if it
 * carries no body, or if decoding would exceed the byte budget; *why (may be
 * NULL) then says which: a static string, NC__WHY_NO_MEMORY when an
 * allocation failed. Free the result with nc__envelope_free().
 */
#define NC__WHY_NO_MEMORY "out of memory while decoding"
Normd__Envelope *nc__envelope_unpack(const uint8_t *body, size_t len, const char **why);
void nc__envelope_free(Normd__Envelope *env);

/*
 * A caller's buffer that unpacking draws from before it allocates, so that
 * decoding a small frame calls malloc not at all (the daemon decodes every
 * request, one at a time). One envelope at a time: the arena is reused
 * once that one is freed with nc__envelope_free_arena().
 */
struct nc__unpack_arena {
	unsigned char *bytes;
	size_t cap, used;
};
/* As nc__envelope_unpack(); `arena` may be NULL (then it allocates as that does). */
Normd__Envelope *nc__envelope_unpack_arena(const uint8_t *body, size_t len,
					   struct nc__unpack_arena *arena, const char **why);
/* Frees an envelope unpacked with `arena` (the same, or NULL) and empties the arena. */
void nc__envelope_free_arena(Normd__Envelope *env, struct nc__unpack_arena *arena);

/*
 * Says in one line why `body` does not decode, naming the message and field
 * where it can ("Job is missing required field 'rows'", "RegisterRegion.size
 * has wire type 2, expected 0"); "malformed envelope" when it cannot tell.
 * Reads the bytes only; allocates nothing.
 */
void nc__envelope_explain(const uint8_t *body, size_t len, char *buf, size_t buf_len);

/* ---- allocation ------------------------------------------------------------
 * Every allocation of the daemon, the library and the codec goes through
 * these, so that tests can make the Nth one fail.
 */
void *nc__malloc(size_t size);
void *nc__calloc(size_t count, size_t size);
void *nc__realloc(void *ptr, size_t size);
char *nc__strdup(const char *s);
void nc__free(void *ptr);

/*
 * Makes allocation number `n` (1-based, counted from this call) fail; 0
 * disables. `on_fail` (may be NULL) is called, on the failing thread, just
 * before that allocation returns NULL; it must not allocate.
 */
void nc__alloc_fail_after(uint64_t n, void (*on_fail)(uint64_t n));

/* Wire status <-> library code. Unknown wire values map to NC_EPROTOCOL_ERROR. */
int nc__status_from_wire(Normd__Status status);
Normd__Status nc__status_to_wire(int code);

#endif /* NORMD_FRAME_H */
