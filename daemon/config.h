/*
 * normd's configuration: one declarative table (config.c) of every setting,
 * filled from defaults, then the config file, then the command line.
 */
#ifndef NORMD_CONFIG_H
#define NORMD_CONFIG_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#define CONFIG_MAX_IDS 32

struct config {
	char *device;            /* "cpu", "0", "0,1" or "all" */
	char *socket;            /* path to listen on unless a socket is inherited */
	uint64_t socket_mode;    /* permission bits of the socket file */
	char *socket_group;      /* group owning the socket file ("" = unchanged) */
	char *state_dir;         /* per-GPU variant cache files */
	char *log_level;         /* error, warn, info, debug */
	uint64_t max_clients;    /* connections at once */
	uint64_t max_frame;      /* bytes in one frame body, either direction */
	uint64_t max_regions;    /* registered regions per connection */
	uint64_t max_mapped_bytes;   /* bytes of registered regions per connection */
	uint64_t max_jobs_in_flight; /* per connection */
	uint64_t max_mappings;       /* client memory mappings, daemon-wide (0 = from max_map_count) */
	uint64_t max_output_bytes;
	uint64_t max_output_bytes_total;   /* unsent reply bytes per connection before disconnect */
	uint64_t max_cols;       /* widest row accepted */
	uint64_t cpu_workers;    /* CPU backend: jobs computed at once (0 = cores) */
	uint64_t cpu_threads;    /* CPU backend: threads per job (0 = cores) */
	uint64_t drain_timeout_ms; /* SIGTERM: give up waiting for jobs after this */
	uint64_t hello_timeout_ms; /* close a connection without Hello after this */
	uint64_t frame_timeout_ms; /* close a connection holding half a frame after this */
	char *allow_uid;         /* comma-separated uids allowed to connect ("" = any) */
	char *allow_gid;         /* comma-separated gids allowed to connect ("" = any) */
	bool autotune;           /* CUDA: time candidate variants on first use */
	uint64_t cuda_workers;   /* CUDA: worker threads (streams) per device */
	uint64_t busy_poll_us;   /* CUDA: spin before sleeping (latency for CPU time) */
	uint64_t loop_spin_us;   /* CUDA: the loop polls this long after the last job arrived */
	uint64_t enqueue_spin_us; /* CUDA: launchers watch waiting jobs without sleeping this long */
	uint64_t enqueue_threads; /* CUDA: launcher threads of the enqueue mode per device */
	char *config_file;       /* the file that was read (NULL: none); not a setting */
};

/* Fills *cfg with the defaults of the table. */
void config_init(struct config *cfg);

/*
 * Applies `argv` (after defaults and an optional --config FILE named in it).
 * Returns 0, or -1 with a message for the operator in `err`. Sets *print_config /
 * *show_help when those flags were given.
 */
int config_parse_args(struct config *cfg, int argc, char **argv, bool *print_config,
		      bool *show_help, char *err, size_t err_len);

/* Reads `key = value` lines from a file; same keys as the long options. */
int config_load_file(struct config *cfg, const char *path, char *err, size_t err_len);

/* Prints the effective configuration as `key = value` lines. */
void config_print(const struct config *cfg, FILE *out);

/* Logs the effective configuration, one line. */
void config_log(const struct config *cfg);

/* Prints the option list. */
void config_usage(FILE *out);

/* Parses a comma-separated id list; returns the count or -1 if malformed. */
int config_parse_ids(const char *list, uint32_t *ids, int max);

void config_free(struct config *cfg);

#endif /* NORMD_CONFIG_H */
