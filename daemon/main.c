/*
 * normd's entry point: read the configuration, pick the backend, run the
 * server, and turn the outcome into an exit status. The only place that
 * decides the process's exit.
 */
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/log.h"
#include "daemon/server.h"

static int backend_create(const struct config *cfg, struct backend **out)
{
	if (!strcmp(cfg->device, "cpu"))
		return backend_cpu_create(cfg, out);
	return backend_cuda_create(cfg, out);
}

int main(int argc, char **argv)
{
	struct config cfg;
	char err[512];
	bool print_config, show_help;
	config_init(&cfg);
	if (config_parse_args(&cfg, argc, argv, &print_config, &show_help, err, sizeof(err))) {
		fprintf(stderr, "normd: %s\n", err);
		config_free(&cfg);
		return 2;
	}
	if (show_help || print_config) {
		if (show_help)
			config_usage(stdout);
		else
			config_print(&cfg, stdout);
		config_free(&cfg);
		return 0;
	}
	if (log_set_level(cfg.log_level) != 0) {
		fprintf(stderr, "normd: log_level '%s' is not error, warn, info or debug\n",
			cfg.log_level);
		config_free(&cfg);
		return 2;
	}
	/*
	 * Large buffers (the CPU kernels' per-job scratch) are mapped and
	 * unmapped each time: a fixed threshold stops glibc from raising it and
	 * keeping such buffers in the heap, where RSS would only ever grow.
	 */
	mallopt(M_MMAP_THRESHOLD, 128 * 1024);
	/* Writes to a vanished client must fail with EPIPE, not kill the daemon. */
	signal(SIGPIPE, SIG_IGN);
	/*
	 * Test hook (tests/integration/test_alloc_failure.c): NORMD_TEST_FAIL_ALLOC=N
	 * makes the Nth allocation after the server starts listening fail.
	 */
	const char *fail_alloc = getenv("NORMD_TEST_FAIL_ALLOC");
	if (fail_alloc)
		server_test_fail_alloc = strtoull(fail_alloc, NULL, 10);
	config_log(&cfg);

	struct backend *backend = NULL;
	int rc = backend_create(&cfg, &backend);
	if (rc != 0) {
		config_free(&cfg);
		return 1;
	}
	/* Once the backend is up: the mappings it made (contexts, threads) come off the cap. */
	region_mappings_init(cfg.max_mappings);
	rc = server_run(&cfg, backend);
	if (server_instance && server_instance->backend)
		backend->destroy(backend);
	config_free(&cfg);
	return rc;
}
