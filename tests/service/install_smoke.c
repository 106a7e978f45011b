/*
 * A client built only from the installed header and library (through
 * pkg-config), as a user's program would be: connects to the daemon named on
 * the command line, pings it, runs one RMSNorm forward on shared host memory
 * and checks it against a reference computed here, and reads the stats.
 * Prints "install smoke: ok" and exits 0 when all of that worked.
 *
 *   install_smoke SOCKET
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <normclient.h>

#define ROWS 8
#define COLS 96

static int fail(const char *what, int rc)
{
	fprintf(stderr, "install smoke: %s: %s: %s\n", what, nc_strerror(rc), nc_last_error());
	return 1;
}

int main(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: install_smoke SOCKET\n");
		return 2;
	}
	nc_conn *conn;
	int rc = nc_connect(argv[1], "install-smoke", 5000, &conn);
	if (rc)
		return fail("connect", rc);
	if ((rc = nc_ping(conn, 5000)))
		return fail("ping", rc);
	nc_region *region;
	size_t bytes = 2 * ROWS * COLS * sizeof(float);
	if ((rc = nc_region_alloc_host(conn, bytes, &region)))
		return fail("region", rc);
	float *x = nc_region_data(region), *y = x + ROWS * COLS;
	for (int i = 0; i < ROWS * COLS; i++)
		x[i] = (float)((i * 37) % 101) / 25.0f - 2.0f;
	struct nc_job job;
	memset(&job, 0, sizeof(job));
	job.op = NC_RMSNORM_FWD;
	job.rows = ROWS;
	job.cols = COLS;
	job.dtype = NC_F32;
	job.x = nc_tensor_at(region, x);
	job.y = nc_tensor_at(region, y);
	struct nc_job_result result;
	if ((rc = nc_job_run(conn, &job, 10000, &result)))
		return fail(result.message, rc);
	double worst = 0.0;
	for (int r = 0; r < ROWS; r++) {
		double ss = 0.0;
		for (int c = 0; c < COLS; c++)
			ss += (double)x[r * COLS + c] * x[r * COLS + c];
		double rstd = 1.0 / sqrt(ss / COLS + 1e-5);
		for (int c = 0; c < COLS; c++) {
			double err = fabs(y[r * COLS + c] - x[r * COLS + c] * rstd);
			worst = err > worst ? err : worst;
		}
	}
	if (worst > 1e-4) {
		fprintf(stderr, "install smoke: RMSNorm result off by %g\n", worst);
		return 1;
	}
	struct nc_stats stats;
	if ((rc = nc_stats_get(conn, 5000, &stats)))
		return fail("stats", rc);
	if (stats.ops[NC_RMSNORM_FWD].jobs_by_status[0] < 1) {
		fprintf(stderr, "install smoke: the job is missing from the stats\n");
		return 1;
	}
	printf("install smoke: ok (normd %s, %s backend, max error %.2g)\n",
	       nc_server_info(conn)->version, nc_server_info(conn)->backend, worst);
	nc_region_free(region);
	nc_close(conn);
	return 0;
}
