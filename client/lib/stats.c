/*
 * Reading the daemon's latency histograms (normclient.h): quantiles from
 * log2 buckets of microseconds, interpolated linearly inside a bucket the
 * way Prometheus' histogram_quantile() does.
 */
#include "client/lib/internal.h"

NC_API double nc_latency_quantile_us(const uint64_t buckets[NC_LATENCY_BUCKETS], double quantile)
{
	if (!buckets)
		return 0.0;
	if (!(quantile > 0.0))
		quantile = 0.0;
	if (quantile > 1.0)
		quantile = 1.0;
	uint64_t total = 0;
	for (int i = 0; i < NC_LATENCY_BUCKETS; i++)
		total += buckets[i];
	if (total == 0)
		return 0.0;
	double rank = quantile * (double)total, below = 0.0;
	for (int i = 0; i < NC_LATENCY_BUCKETS; i++) {
		double count = (double)buckets[i];
		double lower = i == 0 ? 0.0 : (double)(1ull << (i - 1));
		if (count == 0.0 || below + count < rank) {
			below += count;
			continue;
		}
		/* The open last bucket has no upper bound: report its lower one. */
		if (i == NC_LATENCY_BUCKETS - 1)
			return lower;
		double upper = (double)(1ull << i);
		return lower + (upper - lower) * (rank - below) / count;
	}
	return (double)(1ull << (NC_LATENCY_BUCKETS - 2));
}
