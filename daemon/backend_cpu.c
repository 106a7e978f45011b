/*
 * The CPU backend: jobs on host memory (memfd regions), computed by the
 * fp32 CPU kernels. A fixed pool of worker threads takes jobs from one FIFO;
 * each job may itself split its rows over several threads (cpu_threads).
 * Workers touch only their job and hand it back with job_post_completion().
 */
#include "daemon/server.h"

#include <stdio.h>
#include <unistd.h>

#include "daemon/log.h"
#include "proto/frame.h"

struct backend_cpu {
	struct backend base;
	uv_mutex_t lock;
	uv_cond_t wake;
	struct job *head, *tail; /* waiting jobs, FIFO */
	bool stopping;
	int threads_per_job;
	int worker_count;
	uv_thread_t *workers;
};

static void cpu_run_job(struct backend_cpu *cpu, struct job *job)
{
	job->t_start_ns = stats_now_ns();
	if (job->deadline_us && (job->t_start_ns - job->t_arrive_ns) / 1000 > job->deadline_us) {
		job->status = NC_EOUT_OF_RANGE;
		snprintf(job->message, sizeof(job->message),
			 "deadline of %llu us passed before the job could start",
			 (unsigned long long)job->deadline_us);
		job->t_end_ns = stats_now_ns();
		return;
	}
	struct nk_cpu_opts opts = {.precision = NK_CPU_FP32, .threads = cpu->threads_per_job};
	struct nk_norm_result result = {0};
	int rc = job->wgrad ? nk_cpu_wgrad(&job->gemm, &opts) : nk_cpu_norm(&job->args, &opts, &result);
	job->t_end_ns = stats_now_ns();
	job->clamped_cols = result.clamped_cols;
	snprintf(job->variant, sizeof(job->variant), "cpu/%s/fp32/t%d", job->wgrad ? "gemm" : "norm",
		 cpu->threads_per_job);
	if (rc == NK_OK) {
		job->status = NC_OK;
	} else if (rc == NK_ENOMEM) {
		job->status = NC_ERESOURCE_EXHAUSTED;
		snprintf(job->message, sizeof(job->message), "out of memory computing the job");
	} else {
		job->status = NC_EINVALID_ARGUMENT;
		snprintf(job->message, sizeof(job->message), "the CPU kernels refused the job");
	}
}

static int cpu_region_map(struct backend *backend, struct region *twin,
			  const Normd__RegisterRegion *msg, const int *fds, unsigned fd_count,
			  struct region **out, char *why, size_t why_len)
{
	(void)backend;
	(void)twin;
	if (msg->kind != NORMD__REGION_KIND__HOST_MEMFD) {
		for (unsigned i = 0; i < fd_count; i++)
			close(fds[i]);
		if (msg->kind == NORMD__REGION_KIND__CUDA_VMM_FD)
			snprintf(why, why_len, "CUDA_VMM_FD regions (device memory) need the cuda "
				 "backend; this daemon runs the cpu backend (use HOST_MEMFD)");
		else
			snprintf(why, why_len, "region kind %d is not supported by the cpu backend "
				 "(use HOST_MEMFD)", (int)msg->kind);
		return NC_EUNSUPPORTED;
	}
	if (fd_count == 0) {
		snprintf(why, why_len, "HOST_MEMFD region arrived without an fd");
		return NC_EINVALID_ARGUMENT;
	}
	return region_map_memfd(fds[0], msg->region_id, msg->size, out, why, why_len);
}

static const struct backend_device cpu_device = {.index = -1, .name = "host"};

static void cpu_worker(void *arg)
{
	struct backend_cpu *cpu = arg;
	for (;;) {
		uv_mutex_lock(&cpu->lock);
		while (!cpu->head && !cpu->stopping)
			uv_cond_wait(&cpu->wake, &cpu->lock);
		struct job *job = cpu->head;
		if (job) {
			cpu->head = job->next;
			if (!cpu->head)
				cpu->tail = NULL;
		}
		uv_mutex_unlock(&cpu->lock);
		if (!job)
			return; /* stopping and nothing left */
		cpu_run_job(cpu, job);
		job_post_completion(job);
	}
}

static int cpu_submit(struct backend *backend, struct job *job)
{
	struct backend_cpu *cpu = (struct backend_cpu *)backend;
	job->next = NULL;
	uv_mutex_lock(&cpu->lock);
	if (cpu->tail)
		cpu->tail->next = job;
	else
		cpu->head = job;
	cpu->tail = job;
	uv_cond_signal(&cpu->wake);
	uv_mutex_unlock(&cpu->lock);
	return NC_OK;
}

static void cpu_destroy(struct backend *backend)
{
	struct backend_cpu *cpu = (struct backend_cpu *)backend;
	if (!cpu)
		return;
	uv_mutex_lock(&cpu->lock);
	cpu->stopping = true;
	uv_cond_broadcast(&cpu->wake);
	uv_mutex_unlock(&cpu->lock);
	for (int i = 0; i < cpu->worker_count; i++)
		uv_thread_join(&cpu->workers[i]);
	uv_cond_destroy(&cpu->wake);
	uv_mutex_destroy(&cpu->lock);
	nc__free(cpu->workers);
	nc__free(cpu);
}

int backend_cpu_create(const struct config *cfg, struct backend **out)
{
	long cores = sysconf(_SC_NPROCESSORS_ONLN);
	if (cores < 1)
		cores = 1;
	struct backend_cpu *cpu = nc__calloc(1, sizeof(*cpu));
	if (!cpu)
		return NC_ENOMEM;
	cpu->base.name = "cpu";
	cpu->base.kind = NORMD__BACKEND_KIND__BACKEND_CPU;
	cpu->base.devices = &cpu_device;
	cpu->base.device_count = 1;
	cpu->base.region_map = cpu_region_map;
	cpu->base.submit = cpu_submit;
	cpu->base.destroy = cpu_destroy;
	cpu->base.norm_features = NK_FEATURES_ALL;
	cpu->threads_per_job = cfg->cpu_threads ? (int)cfg->cpu_threads : (int)cores;
	int workers = cfg->cpu_workers ? (int)cfg->cpu_workers : (int)cores;
	cpu->workers = nc__calloc((size_t)workers, sizeof(*cpu->workers));
	if (!cpu->workers || uv_mutex_init(&cpu->lock) || uv_cond_init(&cpu->wake)) {
		nc__free(cpu->workers);
		nc__free(cpu);
		return NC_ENOMEM;
	}
	for (; cpu->worker_count < workers; cpu->worker_count++) {
		if (uv_thread_create(&cpu->workers[cpu->worker_count], cpu_worker, cpu) != 0)
			break;
	}
	if (cpu->worker_count == 0) {
		cpu_destroy(&cpu->base);
		return NC_EINTERNAL;
	}
	log_info("event=backend name=cpu workers=%d threads_per_job=%d", cpu->worker_count,
		 cpu->threads_per_job);
	*out = &cpu->base;
	return 0;
}
