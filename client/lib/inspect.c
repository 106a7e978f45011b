/*
 * Asking the daemon about itself: nc_ping (is it there and answering) and
 * nc_variants_get (the kernel variants it chose per device and shape).
 * Its counters are in stats.c.
 */
#include "client/lib/internal.h"
#include "proto/frame.h"

NC_API int nc_ping(nc_conn *conn, int timeout_ms)
{
	if (!conn)
		return nc__fail(NC_EINVALID_ARGUMENT, "conn is NULL");
	Normd__Ping ping = NORMD__PING__INIT;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.body_case = NORMD__ENVELOPE__BODY_PING;
	env.ping = &ping;
	Normd__Envelope *reply;
	int rc =
	    nc__call_expect(conn, &env, timeout_ms, NORMD__ENVELOPE__BODY_PONG, "Ping", &reply);
	if (rc == 0)
		nc__envelope_free(reply);
	return rc;
}

NC_API int nc_variants_get(nc_conn *conn, int timeout_ms, struct nc_variant_info **out,
			   size_t *count)
{
	if (!conn || !out || !count)
		return nc__fail(NC_EINVALID_ARGUMENT, "conn, out and count must not be NULL");
	Normd__VariantsRequest req = NORMD__VARIANTS_REQUEST__INIT;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.body_case = NORMD__ENVELOPE__BODY_VARIANTS;
	env.variants = &req;
	Normd__Envelope *reply;
	int rc = nc__call_expect(conn, &env, timeout_ms, NORMD__ENVELOPE__BODY_VARIANTS_REPLY,
				 "Variants", &reply);
	if (rc)
		return rc;
	const Normd__VariantsReply *v = reply->variants_reply;
	struct nc_variant_info *list = nc__calloc(v->n_entries ? v->n_entries : 1, sizeof(*list));
	if (!list) {
		nc__envelope_free(reply);
		return nc__fail(NC_ENOMEM, "out of memory for the variant list");
	}
	for (size_t i = 0; i < v->n_entries; i++) {
		const Normd__VariantEntry *e = v->entries[i];
		list[i].device = e->device;
		list[i].op = (enum nc_op)e->op;
		list[i].dtype = (enum nc_dtype)e->dtype;
		list[i].weight_dtype = (enum nc_dtype)e->weight_dtype;
		list[i].flags = e->flags;
		list[i].cols = e->cols;
		nc__copy_string(list[i].variant, sizeof(list[i].variant), e->variant);
		nc__copy_string(list[i].source, sizeof(list[i].source), e->source);
		list[i].uses = e->uses;
	}
	*out = list;
	*count = v->n_entries;
	nc__envelope_free(reply);
	return 0;
}

NC_API void nc_variants_free(struct nc_variant_info *list)
{
	nc__free(list);
}
