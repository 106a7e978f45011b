/*
 * Where settings come from: defaults, then the config file (--config FILE,
 * or the default file when it exists and no --config is given), then the
 * command line, which wins. The default file's path is compiled in; this
 * test builds daemon/config.c itself with that path pointing at a file of
 * its own, so it never depends on (or touches) /etc/normd.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char test_default_config[128];
#define NORMD_DEFAULT_CONFIG test_default_config
#include "daemon/config.c"
#include "daemon/log.c"

static char test_dir[64];
static char other_config[160];

static void write_file(const char *path, const char *text)
{
	FILE *f = fopen(path, "w");
	assert_non_null(f);
	fputs(text, f);
	fclose(f);
}

static int setup(void **state)
{
	(void)state;
	snprintf(test_dir, sizeof(test_dir), "/tmp/normd-config.XXXXXX");
	if (!mkdtemp(test_dir))
		return -1;
	snprintf(test_default_config, sizeof(test_default_config), "%s/normd.conf", test_dir);
	snprintf(other_config, sizeof(other_config), "%s/other.conf", test_dir);
	return 0;
}

static int teardown(void **state)
{
	(void)state;
	unlink(test_default_config);
	unlink(other_config);
	rmdir(test_dir);
	return 0;
}

/* Parses argv (NULL-terminated) into cfg; returns config_parse_args' result. */
static int parse(struct config *cfg, const char **args)
{
	char *argv[16] = {"normd"};
	int argc = 1;
	for (int i = 0; args && args[i] && argc < 15; i++)
		argv[argc++] = (char *)args[i];
	bool print_config, show_help;
	char err[512];
	config_init(cfg);
	int rc = config_parse_args(cfg, argc, argv, &print_config, &show_help, err, sizeof(err));
	if (rc)
		fprintf(stderr, "config error: %s\n", err);
	return rc;
}

static void test_missing_default_file_means_defaults(void **state)
{
	(void)state;
	struct config cfg;
	unlink(test_default_config);
	assert_int_equal(parse(&cfg, NULL), 0);
	assert_null(cfg.config_file);
	assert_int_equal(cfg.max_clients, 256);
	assert_string_equal(cfg.socket, "/run/normd/0.sock");
	config_free(&cfg);
}

static void test_default_file_is_read_and_flags_win(void **state)
{
	(void)state;
	struct config cfg;
	write_file(test_default_config, "# a comment\nmax_clients = 7\nsocket-group = normd\n");
	assert_int_equal(parse(&cfg, NULL), 0);
	assert_string_equal(cfg.config_file, test_default_config);
	assert_int_equal(cfg.max_clients, 7);
	assert_string_equal(cfg.socket_group, "normd");
	config_free(&cfg);

	const char *args[] = {"--max-clients", "9", NULL};
	assert_int_equal(parse(&cfg, args), 0);
	assert_int_equal(cfg.max_clients, 9);
	assert_string_equal(cfg.socket_group, "normd");
	config_free(&cfg);
}

static void test_explicit_config_replaces_the_default(void **state)
{
	(void)state;
	struct config cfg;
	write_file(test_default_config, "max_clients = 7\n");
	write_file(other_config, "max_regions = 5\n");
	const char *args[] = {"--config", other_config, NULL};
	assert_int_equal(parse(&cfg, args), 0);
	assert_string_equal(cfg.config_file, other_config);
	assert_int_equal(cfg.max_clients, 256); /* the default file was not read */
	assert_int_equal(cfg.max_regions, 5);
	config_free(&cfg);

	/* --config /dev/null reads nothing at all. */
	const char *none[] = {"--config=/dev/null", NULL};
	assert_int_equal(parse(&cfg, none), 0);
	assert_int_equal(cfg.max_clients, 256);
	config_free(&cfg);
}

static void test_bad_files_are_refused(void **state)
{
	(void)state;
	struct config cfg;
	write_file(test_default_config, "no_such_setting = 1\n");
	assert_int_equal(parse(&cfg, NULL), -1);
	config_free(&cfg);
	unlink(test_default_config);
	const char *args[] = {"--config", "/nonexistent/normd.conf", NULL};
	assert_int_equal(parse(&cfg, args), -1);
	config_free(&cfg);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	    cmocka_unit_test(test_missing_default_file_means_defaults),
	    cmocka_unit_test(test_default_file_is_read_and_flags_win),
	    cmocka_unit_test(test_explicit_config_replaces_the_default),
	    cmocka_unit_test(test_bad_files_are_refused),
	};
	return cmocka_run_group_tests(tests, setup, teardown);
}
