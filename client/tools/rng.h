/*
 * The one pseudo-random generator of the tools, tests and benchmarks:
 * splitmix64, small, seedable and good enough for test data; each caller
 * keeps its own state, so every thread or job can have its own stream.
 * The same seed gives the same sequence everywhere, which tests that
 * compare with a reference rely on.
 */
#ifndef NORMD_RNG_H
#define NORMD_RNG_H

#include <stdint.h>

/* The next 64 random bits; advances *state. */
static inline uint64_t rng_next(uint64_t *state)
{
	uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

/* Uniform in [0, 1), from the top 53 bits. */
static inline double rng_unit(uint64_t *state)
{
	return (double)(rng_next(state) >> 11) * 0x1.0p-53;
}

/* Uniform in [lo, hi). */
static inline double rng_uniform(uint64_t *state, double lo, double hi)
{
	return lo + (hi - lo) * rng_unit(state);
}

/* Uniform in [0, n); 0 when n is 0. */
static inline uint64_t rng_below(uint64_t *state, uint64_t n)
{
	return n ? rng_next(state) % n : 0;
}

#endif /* NORMD_RNG_H */
