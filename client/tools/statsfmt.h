/*
 * statsfmt: the daemon's counters (struct nc_stats) as a person reads them,
 * as JSON, and in the Prometheus text exposition format (version 0.0.4)
 * that node_exporter's textfile collector reads. Used by `normctl stats`.
 */
#ifndef NORMD_STATSFMT_H
#define NORMD_STATSFMT_H

#include <stdio.h>

#include "normclient.h"

void statsfmt_text(FILE *out, const struct nc_stats *s);
void statsfmt_json(FILE *out, const struct nc_stats *s);
/* `version` is the daemon's (nc_server_info); may be NULL. */
void statsfmt_prometheus(FILE *out, const struct nc_stats *s, const char *version);
/* What to print when the daemon cannot be reached: normd_up 0. */
void statsfmt_prometheus_down(FILE *out);

/* "layernorm_fwd", ... for an nc_op slot; "unknown" for slot 0 and others. */
const char *statsfmt_op_name(unsigned op);

#endif /* NORMD_STATSFMT_H */
