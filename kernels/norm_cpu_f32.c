/* The CPU row math in fp32: the CPU backend (NK_CPU_FP32). */
#define REAL float
#define REAL_SQRT sqrtf
#define NORM_CPU_KERNELS norm_cpu_kernels_f32
#include "norm_cpu_row.h"
