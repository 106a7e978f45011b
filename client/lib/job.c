/*
 * Jobs: turning struct nc_job into a Job message, submitting it, and turning
 * the JobReply back into struct nc_job_result.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "client/lib/internal.h"
#include "proto/frame.h"

static Normd__Tensor *tensor_msg(Normd__Tensor *slot, struct nc_tensor t)
{
	if (t.region == 0)
		return NULL;
	normd__tensor__init(slot);
	slot->region_id = t.region;
	slot->has_offset = true;
	slot->offset = t.offset;
	return slot;
}

/* The protocol-3 fields, sent only when used. */
static void job_ext_to_msg(const struct nc_job_ext *ext, Normd__Job *msg, Normd__Tensor *ts)
{
	msg->residual = tensor_msg(&ts[11], ext->residual);
	msg->residual_out = tensor_msg(&ts[12], ext->residual_out);
	msg->ds = tensor_msg(&ts[13], ext->ds);
	msg->scale = tensor_msg(&ts[14], ext->scale);
	msg->amax = tensor_msg(&ts[15], ext->amax);
	if (ext->weight_offset != 0.0f) {
		msg->has_weight_offset = true;
		msg->weight_offset = ext->weight_offset;
	}
	if (ext->y_dtype) {
		msg->has_y_dtype = true;
		msg->y_dtype = (Normd__DType)ext->y_dtype;
	}
}

int nc__job_ext_check(const struct nc_job_ext *ext)
{
	for (size_t i = 0; ext && i < sizeof(ext->reserved) / sizeof(ext->reserved[0]); i++) {
		if (ext->reserved[i])
			return nc__fail(NC_EINVALID_ARGUMENT,
					"struct nc_job_ext: reserved[%zu] must be zero", i);
	}
	return 0;
}

void nc__job_to_msg(const struct nc_job *job, const struct nc_job_ext *ext, Normd__Job *msg,
		    Normd__Tensor *ts)
{
	normd__job__init(msg);
	msg->op = (Normd__Op)job->op;
	msg->rows = job->rows;
	msg->cols = job->cols;
	msg->has_eps = true;
	msg->eps = job->eps == 0.0f ? 1e-5f : job->eps;
	msg->dtype = (Normd__DType)job->dtype;
	if (job->weight_dtype) {
		msg->has_weight_dtype = true;
		msg->weight_dtype = (Normd__DType)job->weight_dtype;
	}
	msg->has_memory_efficient = msg->has_accumulate = true;
	msg->memory_efficient = (job->flags & NC_MEMORY_EFFICIENT) != 0;
	msg->accumulate = (job->flags & NC_ACCUMULATE) != 0;
	if (job->deadline_us) {
		msg->has_deadline_us = true;
		msg->deadline_us = job->deadline_us;
	}
	msg->x = tensor_msg(&ts[0], job->x);
	msg->y = tensor_msg(&ts[1], job->y);
	msg->mean = tensor_msg(&ts[2], job->mean);
	msg->rstd = tensor_msg(&ts[3], job->rstd);
	msg->gamma = tensor_msg(&ts[4], job->gamma);
	msg->beta = tensor_msg(&ts[5], job->beta);
	msg->dy = tensor_msg(&ts[6], job->dy);
	msg->dx = tensor_msg(&ts[7], job->dx);
	msg->dgamma = tensor_msg(&ts[8], job->dgamma);
	msg->dbeta = tensor_msg(&ts[9], job->dbeta);
	if (job->op == NC_WGRAD_ACCUM) {
		msg->has_out_features = msg->has_gemm_beta = true;
		msg->out_features = job->out_features;
		msg->gemm_beta = (job->flags & NC_OVERWRITE) ? 0 : 1;
		msg->main_grad = tensor_msg(&ts[10], job->main_grad);
	}
	if (ext)
		job_ext_to_msg(ext, msg, ts);
}

int nc__job_submit_event(nc_conn *conn, const struct nc_job *job, const struct nc_job_ext *ext,
			 const uint8_t *wait_event, bool early_reply, uint64_t *request_id)
{
	if (!conn || !job || !request_id)
		return nc__fail(NC_EINVALID_ARGUMENT, "conn, job and request_id must not be NULL");
	int rc = nc__job_ext_check(ext);
	if (rc)
		return rc;
	Normd__Job msg;
	Normd__Tensor ts[NC__JOB_TENSORS];
	nc__job_to_msg(job, ext, &msg, ts);
	if (wait_event) {
		msg.has_wait_event = true;
		msg.wait_event.data = (uint8_t *)wait_event;
		msg.wait_event.len = 64;
	}
	msg.has_early_reply = msg.early_reply = early_reply;
	Normd__Envelope env = NORMD__ENVELOPE__INIT;
	env.body_case = NORMD__ENVELOPE__BODY_JOB;
	env.job = &msg;
	return nc__submit(conn, &env, -1, request_id);
}

NC_API int nc_job_submit(nc_conn *conn, const struct nc_job *job, uint64_t *request_id)
{
	return nc__job_submit_event(conn, job, NULL, NULL, false, request_id);
}

NC_API int nc_job_submit_ext(nc_conn *conn, const struct nc_job *job,
			     const struct nc_job_ext *ext, uint64_t *request_id)
{
	return nc__job_submit_event(conn, job, ext, NULL, false, request_id);
}

NC_API uint32_t nc_server_norm_features(const nc_conn *conn)
{
	return conn ? conn->norm_features : 0;
}

static int result_fail(struct nc_job_result *result, int status)
{
	memset(result, 0, sizeof(*result));
	result->status = status;
	snprintf(result->message, sizeof(result->message), "%s", nc_last_error());
	return status;
}

NC_API int nc_job_wait(nc_conn *conn, uint64_t request_id, int timeout_ms,
		       struct nc_job_result *result)
{
	return nc__job_wait_event(conn, request_id, timeout_ms, result, NULL);
}

int nc__job_wait_event(nc_conn *conn, uint64_t request_id, int timeout_ms,
		       struct nc_job_result *result, uint8_t *done_event)
{
	struct nc_job_result ignored;
	if (!result)
		result = &ignored;
	if (!conn)
		return result_fail(result, nc__fail(NC_EINVALID_ARGUMENT, "conn is NULL"));
	Normd__Envelope *reply;
	int rc = nc__await(conn, request_id, timeout_ms, &reply);
	if (rc)
		return result_fail(result, rc);
	memset(result, 0, sizeof(*result));
	const char *message = NULL;
	if (reply->body_case == NORMD__ENVELOPE__BODY_JOB_REPLY) {
		const Normd__JobReply *r = reply->job_reply;
		result->status = nc__status_from_wire(r->status);
		result->clamped_cols = r->clamped_cols;
		result->device_us = r->device_us;
		result->queue_us = r->queue_us;
		snprintf(result->variant, sizeof(result->variant), "%s",
			 r->variant ? r->variant : "");
		message = r->message;
		if (done_event) {
			bool ok = r->has_done_event && r->done_event.len == 64;
			memset(done_event, 0, 64);
			if (ok)
				memcpy(done_event, r->done_event.data, 64);
		}
	} else if (reply->body_case == NORMD__ENVELOPE__BODY_RESULT) {
		/* Refused before it became a job (limits, shutdown). */
		result->status = nc__status_from_wire(reply->result->status);
		if (result->status == NC_OK)
			result->status = NC_EPROTOCOL_ERROR;
		message = reply->result->message;
	} else {
		result->status = NC_EPROTOCOL_ERROR;
		message = "unexpected reply to a job";
	}
	snprintf(result->message, sizeof(result->message), "%s", message ? message : "");
	if (result->status)
		nc__fail(result->status, "%s", result->message);
	nc__envelope_free(reply);
	return result->status;
}

NC_API int nc_job_run(nc_conn *conn, const struct nc_job *job, int timeout_ms,
		      struct nc_job_result *result)
{
	return nc_job_run_ext(conn, job, NULL, timeout_ms, result);
}

NC_API int nc_job_run_ext(nc_conn *conn, const struct nc_job *job, const struct nc_job_ext *ext,
			  int timeout_ms, struct nc_job_result *result)
{
	uint64_t id;
	int rc = nc_job_submit_ext(conn, job, ext, &id);
	if (rc) {
		struct nc_job_result ignored;
		return result_fail(result ? result : &ignored, rc);
	}
	return nc_job_wait(conn, id, timeout_ms, result);
}
