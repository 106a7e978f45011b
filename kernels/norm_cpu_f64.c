/* The CPU row math in fp64: the reference (NK_CPU_REFERENCE). */
#define REAL double
#define REAL_SQRT sqrt
#define NORM_CPU_KERNELS norm_cpu_kernels_f64
#include "norm_cpu_row.h"
