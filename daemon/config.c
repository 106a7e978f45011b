/*
 * The configuration table: every setting's name, type, default, bounds and
 * help in one place. The command line (--name VALUE or --name=VALUE), the
 * config file (name = value) and --print-config all read this table.
 */
#include "daemon/config.h"

#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/log.h"
#include "proto/frame.h"

/* Read when no --config is given and it exists (systemd/README.md). */
#ifndef NORMD_DEFAULT_CONFIG
#define NORMD_DEFAULT_CONFIG "/etc/normd/normd.conf"
#endif

enum config_type { CONFIG_STRING, CONFIG_UINT, CONFIG_BOOL };

struct config_entry {
	const char *name;
	enum config_type type;
	size_t offset;
	const char *default_value;
	uint64_t min, max; /* CONFIG_UINT bounds, inclusive */
	const char *help;
};

#define STR(field, def, help) {#field, CONFIG_STRING, offsetof(struct config, field), def, 0, 0, help}
#define UINT(field, def, lo, hi, help)                                                     \
	{#field, CONFIG_UINT, offsetof(struct config, field), def, lo, hi, help}
#define BOOL(field, def, help) {#field, CONFIG_BOOL, offsetof(struct config, field), def, 0, 1, help}

static const struct config_entry config_table[] = {
	STR(device, "0", "backend and devices: cpu, 0, 0,1 or all"),
	STR(socket, "/run/normd/0.sock", "Unix socket to listen on"),
	UINT(socket_mode, "0660", 0, 0777, "permission bits of the socket (octal)"),
	STR(socket_group, "", "group that owns the socket (empty: unchanged)"),
	STR(state_dir, "/var/lib/normd", "where per-GPU variant caches are kept"),
	STR(log_level, "info", "error, warn, info or debug"),
	UINT(max_clients, "256", 1, 65536, "connections at once"),
	UINT(max_frame, "65536", 256, 16777216, "largest frame body in bytes"),
	UINT(max_regions, "1024", 1, 1048576, "registered regions per connection"),
	UINT(max_mapped_bytes, "1099511627776", 1, UINT64_MAX, "registered bytes per connection"),
	UINT(max_jobs_in_flight, "1024", 1, 1048576, "jobs in flight per connection"),
	UINT(max_mappings, "0", 0, UINT32_MAX,
	     "mappings of client memory, all clients together (0: from vm.max_map_count)"),
	UINT(max_output_bytes, "4194304", 4096, 1073741824,
	     "memory of unread replies per connection (reading pauses at half; past it, dropped)"),
	UINT(max_output_bytes_total, "268435456", 4096, UINT64_MAX,
	     "memory of unread replies, all connections together (reading from connections with "
	     "unread replies pauses at half; past it, the one whose reply does not fit is dropped)"),
	UINT(max_cols, "16777216", 1, 1073741824, "widest row accepted"),
	UINT(cpu_workers, "0", 0, 1024, "CPU backend: jobs computed at once (0: one per core)"),
	UINT(cpu_threads, "0", 0, 1024, "CPU backend: threads per large job (0: cores)"),
	UINT(drain_timeout_ms, "30000", 0, 3600000, "SIGTERM: longest wait for in-flight jobs"),
	UINT(hello_timeout_ms, "10000", 100, 3600000,
	     "a connection that has not sent Hello this long after connecting is closed"),
	UINT(frame_timeout_ms, "10000", 100, 3600000,
	     "a connection that holds a started frame this long is closed"),
	STR(allow_uid, "", "uids allowed to connect, comma-separated (empty: any)"),
	STR(allow_gid, "", "gids allowed to connect, comma-separated (empty: any)"),
	BOOL(autotune, "false", "time candidate kernel variants on first use"),
	UINT(cuda_workers, "8", 1, 64, "CUDA: worker threads (each with its own stream) per device"),
	UINT(busy_poll_us, "200", 0, 100000,
	     "CUDA: workers spin this long for new jobs, and the loop polls for completions "
	     "while jobs run, instead of sleeping (0: always sleep)"),
	UINT(loop_spin_us, "1000", 0, 1000000,
	     "CUDA: the loop polls its sockets without sleeping for this long after the last job "
	     "arrived, so that a client's next request needs no wake-up (0: only while jobs run)"),
	UINT(enqueue_spin_us, "200", 0, 1000000,
	     "CUDA: a launcher whose jobs wait for their callers' GPUs watches their ready words "
	     "without sleeping for this long after its last launch or new job, then every 20 us"),
	UINT(enqueue_threads, "2", 1, 16,
	     "CUDA: threads per device that launch enqueued jobs (never waiting for the GPU)"),
};

#define CONFIG_ENTRIES (sizeof(config_table) / sizeof(config_table[0]))

static const struct config_entry *config_find(const char *name, size_t len)
{
	for (size_t i = 0; i < CONFIG_ENTRIES; i++) {
		const char *n = config_table[i].name;
		if (strlen(n) != len)
			continue;
		/* Accept both socket and socket-path. */
		size_t j = 0;
		while (j < len && (n[j] == name[j] || (n[j] == '_' && name[j] == '-')))
			j++;
		if (j == len)
			return &config_table[i];
	}
	return NULL;
}

static int parse_bool(const char *value, bool *out)
{
	if (!strcmp(value, "true") || !strcmp(value, "yes") || !strcmp(value, "1")) {
		*out = true;
		return 0;
	}
	if (!strcmp(value, "false") || !strcmp(value, "no") || !strcmp(value, "0")) {
		*out = false;
		return 0;
	}
	return -1;
}

static int config_set(struct config *cfg, const struct config_entry *e, const char *value,
		      char *err, size_t err_len)
{
	char *field = (char *)cfg + e->offset;
	if (e->type == CONFIG_STRING) {
		char *copy = nc__strdup(value);
		if (!copy) {
			snprintf(err, err_len, "%s: out of memory", e->name);
			return -1;
		}
		nc__free(*(char **)field);
		*(char **)field = copy;
		return 0;
	}
	if (e->type == CONFIG_BOOL) {
		if (parse_bool(value, (bool *)field) == 0)
			return 0;
		snprintf(err, err_len, "%s: '%s' is not true or false", e->name, value);
		return -1;
	}
	char *end;
	errno = 0;
	unsigned long long v = strtoull(value, &end, 0);
	if (errno || end == value || *end || value[0] == '-' || v < e->min || v > e->max) {
		snprintf(err, err_len, "%s: '%s' is not a number in [%llu, %llu]", e->name, value,
			 (unsigned long long)e->min, (unsigned long long)e->max);
		return -1;
	}
	*(uint64_t *)field = v;
	return 0;
}

void config_init(struct config *cfg)
{
	char err[256];
	memset(cfg, 0, sizeof(*cfg));
	for (size_t i = 0; i < CONFIG_ENTRIES; i++)
		config_set(cfg, &config_table[i], config_table[i].default_value, err, sizeof(err));
}

void config_free(struct config *cfg)
{
	for (size_t i = 0; i < CONFIG_ENTRIES; i++) {
		if (config_table[i].type != CONFIG_STRING)
			continue;
		char **field = (char **)((char *)cfg + config_table[i].offset);
		nc__free(*field);
		*field = NULL;
	}
	nc__free(cfg->config_file);
	cfg->config_file = NULL;
}

static char *trim(char *s)
{
	while (*s == ' ' || *s == '\t')
		s++;
	char *end = s + strlen(s);
	while (end > s && (end[-1] == ' ' || end[-1] == '\t' || end[-1] == '\n' || end[-1] == '\r'))
		*--end = '\0';
	return s;
}

int config_load_file(struct config *cfg, const char *path, char *err, size_t err_len)
{
	FILE *f = fopen(path, "r");
	if (!f) {
		snprintf(err, err_len, "config file %s: %s", path, strerror(errno));
		return -1;
	}
	char line[1024];
	int lineno = 0, rc = 0;
	while (rc == 0 && fgets(line, sizeof(line), f)) {
		lineno++;
		char *s = trim(line);
		if (*s == '\0' || *s == '#')
			continue;
		char *eq = strchr(s, '=');
		if (!eq) {
			snprintf(err, err_len, "%s:%d: expected 'name = value'", path, lineno);
			rc = -1;
			break;
		}
		*eq = '\0';
		char *key = trim(s), *value = trim(eq + 1);
		const struct config_entry *e = config_find(key, strlen(key));
		if (!e) {
			snprintf(err, err_len, "%s:%d: unknown setting '%s'", path, lineno, key);
			rc = -1;
			break;
		}
		rc = config_set(cfg, e, value, err, err_len);
	}
	fclose(f);
	return rc;
}

/* Loads a file and remembers its name for the logs and --print-config. */
static int config_load_named(struct config *cfg, const char *path, char *err, size_t err_len)
{
	if (config_load_file(cfg, path, err, err_len))
		return -1;
	nc__free(cfg->config_file);
	cfg->config_file = nc__strdup(path);
	return 0;
}

/*
 * Finds --config in argv first, so the file applies before the other flags.
 * Without --config, the default file is read when it exists (a missing one
 * is no error; an unreadable one is). `--config /dev/null` reads nothing.
 */
static int config_apply_file_arg(struct config *cfg, int argc, char **argv, char *err,
				 size_t err_len)
{
	for (int i = 1; i < argc; i++) {
		if (!strncmp(argv[i], "--config=", 9))
			return config_load_named(cfg, argv[i] + 9, err, err_len);
		if (!strcmp(argv[i], "--config")) {
			if (i + 1 >= argc) {
				snprintf(err, err_len, "--config needs a file name");
				return -1;
			}
			return config_load_named(cfg, argv[i + 1], err, err_len);
		}
	}
	if (access(NORMD_DEFAULT_CONFIG, F_OK) != 0 && (errno == ENOENT || errno == ENOTDIR))
		return 0;
	return config_load_named(cfg, NORMD_DEFAULT_CONFIG, err, err_len);
}

int config_parse_args(struct config *cfg, int argc, char **argv, bool *print_config,
		      bool *show_help, char *err, size_t err_len)
{
	*print_config = *show_help = false;
	if (config_apply_file_arg(cfg, argc, argv, err, err_len))
		return -1;
	for (int i = 1; i < argc; i++) {
		const char *arg = argv[i];
		if (!strcmp(arg, "--print-config")) {
			*print_config = true;
			continue;
		}
		if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) {
			*show_help = true;
			continue;
		}
		if (strncmp(arg, "--", 2)) {
			snprintf(err, err_len, "unexpected argument '%s' (see --help)", arg);
			return -1;
		}
		const char *name = arg + 2, *eq = strchr(name, '=');
		size_t name_len = eq ? (size_t)(eq - name) : strlen(name);
		if (name_len == 6 && !strncmp(name, "config", 6)) {
			i += eq ? 0 : 1;
			continue;
		}
		const struct config_entry *e = config_find(name, name_len);
		if (!e) {
			snprintf(err, err_len, "unknown option '%s' (see --help)", arg);
			return -1;
		}
		const char *value = eq ? eq + 1 : NULL;
		if (!value && e->type == CONFIG_BOOL)
			value = "true";
		if (!value && i + 1 < argc)
			value = argv[++i];
		if (!value) {
			snprintf(err, err_len, "option '%s' needs a value", arg);
			return -1;
		}
		if (config_set(cfg, e, value, err, err_len))
			return -1;
	}
	return 0;
}

static void config_format(const struct config *cfg, const struct config_entry *e, char *buf,
			  size_t len)
{
	const char *field = (const char *)cfg + e->offset;
	if (e->type == CONFIG_STRING)
		snprintf(buf, len, "%s", *(char *const *)field);
	else if (e->type == CONFIG_BOOL)
		snprintf(buf, len, "%s", *(const bool *)field ? "true" : "false");
	else if (!strcmp(e->name, "socket_mode"))
		snprintf(buf, len, "0%llo", (unsigned long long)*(const uint64_t *)field);
	else
		snprintf(buf, len, "%llu", (unsigned long long)*(const uint64_t *)field);
}

void config_print(const struct config *cfg, FILE *out)
{
	char value[512];
	fprintf(out, "# effective configuration; config file: %s\n",
		cfg->config_file ? cfg->config_file : "none");
	for (size_t i = 0; i < CONFIG_ENTRIES; i++) {
		config_format(cfg, &config_table[i], value, sizeof(value));
		fprintf(out, "%s = %s\n", config_table[i].name, value);
	}
}

void config_log(const struct config *cfg)
{
	char line[2048], value[512];
	size_t used = 0;
	line[0] = '\0';
	for (size_t i = 0; i < CONFIG_ENTRIES && used < sizeof(line); i++) {
		config_format(cfg, &config_table[i], value, sizeof(value));
		used += (size_t)snprintf(line + used, sizeof(line) - used, " %s=%s",
					 config_table[i].name, value[0] ? value : "\"\"");
	}
	log_info("event=config file=%s%s", cfg->config_file ? cfg->config_file : "none", line);
}

void config_usage(FILE *out)
{
	fprintf(out, "usage: normd [--config FILE] [--print-config] [--OPTION VALUE ...]\n\n"
		     "Settings come from their defaults, then the config file (--config FILE, or\n"
		     "%s when it exists), then the command line, which wins.\n\n",
		NORMD_DEFAULT_CONFIG);
	char value[512];
	struct config defaults;
	config_init(&defaults);
	for (size_t i = 0; i < CONFIG_ENTRIES; i++) {
		config_format(&defaults, &config_table[i], value, sizeof(value));
		fprintf(out, "  --%-20s %s (default: %s)\n", config_table[i].name,
			config_table[i].help, value[0] ? value : "\"\"");
	}
	config_free(&defaults);
}

int config_parse_ids(const char *list, uint32_t *ids, int max)
{
	int n = 0;
	const char *s = list;
	while (*s) {
		char *end;
		errno = 0;
		unsigned long v = strtoul(s, &end, 10);
		if (errno || end == s || v > UINT32_MAX || n == max || (*end && *end != ','))
			return -1;
		ids[n++] = (uint32_t)v;
		s = *end ? end + 1 : end;
	}
	return n;
}
