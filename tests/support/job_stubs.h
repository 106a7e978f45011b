/*
 * Stubs of the server functions daemon/job.c calls beyond job validation,
 * for unit tests that compile job.c into themselves (#include
 * "daemon/job.c"): never reached by job_validate(), so they do nothing.
 * Include once, after job.c.
 */
#ifndef NORMD_TESTS_JOB_STUBS_H
#define NORMD_TESTS_JOB_STUBS_H

void reply_result(struct client *c, uint64_t request_id, int status, const char *fmt, ...)
{
	(void)c, (void)request_id, (void)status, (void)fmt;
}
void reply_job(struct client *c, const struct job *job)
{
	(void)c, (void)job;
}
void stats_count_job(struct server *srv, const struct job *job, bool ran)
{
	(void)srv, (void)job, (void)ran;
}
void server_job_started(struct server *srv, uint64_t now_ns)
{
	(void)srv, (void)now_ns;
}
void stats_count_rejection(struct server *srv, enum nc_reject_reason reason)
{
	(void)srv, (void)reason;
}
void server_fail(struct server *srv, const char *why)
{
	(void)srv, (void)why;
}
void server_drain_check(struct server *srv)
{
	(void)srv;
}
uint64_t stats_now_ns(void)
{
	return 0;
}
int estream_for_job(struct client *c, const Normd__Enqueue *msg, struct estream **out, char *why,
		    size_t why_len)
{
	(void)c, (void)msg, (void)out, (void)why, (void)why_len;
	return NC_EINTERNAL;
}
void estream_push(struct estream *es, struct job *job)
{
	(void)es, (void)job;
}
void estream_job_done(struct job *job)
{
	(void)job;
}
void estream_poll(struct server *srv)
{
	(void)srv;
}
bool estream_poll_due(struct server *srv)
{
	(void)srv;
	return false;
}

#endif /* NORMD_TESTS_JOB_STUBS_H */
