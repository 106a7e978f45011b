/*
 * Inline PTX wrappers (private to kernels/): loads that skip L1, the
 * optimizer barrier of launder(), cp.async copies (sm_80 and later), and
 * the TMA, mbarrier and cluster primitives of the tma_slice kernels
 * (sm_90, under NKC_TMA).
 */
#ifndef NORMD_NORM_CUDA_PTX_CUH
#define NORMD_NORM_CUDA_PTX_CUH

#include <cuda_runtime.h>
#include <stdint.h>

namespace nkc
{

/*
 * 16 bytes of a tensor read exactly once: through the read-only path
 * without allocating in L1, which stays free for the weights every row
 * reloads.
 */
__device__ __forceinline__ uint4 load_stream(const uint4 *p)
{
	uint4 u;
	asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
	    : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w)
	    : "l"(p));
	return u;
}

/*
 * Hides a value from the optimizer, so that work recomputed from it after a
 * barrier is recomputed (cheap) instead of kept live across the barrier in
 * registers (which costs occupancy or spills).
 */
__device__ __forceinline__ void launder(uint4 &u)
{
	asm volatile("" : "+r"(u.x), "+r"(u.y), "+r"(u.z), "+r"(u.w));
}
template <typename P> __device__ __forceinline__ P *launder(P *ptr)
{
	asm volatile("" : "+l"(ptr));
	return ptr;
}

/*
 * Asynchronous 16-byte copies from device to shared memory that bypass L1
 * (sm_80 and later). Every thread waits only for its own copies, so a slot
 * that one thread fills and reads needs no barrier.
 */
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem)
{
	const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
	asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit()
{
	asm volatile("cp.async.commit_group;" ::: "memory");
}
/* Waits until at most N of this thread's newest copy groups are in flight. */
template <int N> __device__ __forceinline__ void cp_async_wait()
{
	asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

/*
 * TMA primitives (sm_90; the tma_slice kernels, norm_cuda_*_tma.cu): bulk
 * copies into shared memory that complete an mbarrier, and stores into the
 * shared memory of another block of the cluster that complete its mbarrier.
 */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define NKC_TMA 1
#endif

#ifdef NKC_TMA
__device__ __forceinline__ unsigned shared_addr(const void *p)
{
	return (unsigned)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void mbarrier_init(unsigned long long *bar, unsigned count)
{
	asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_addr(bar)), "r"(count)
		     : "memory");
}

/* Makes initialized mbarriers visible to the async proxy (the bulk copies). */
__device__ __forceinline__ void mbarrier_init_fence()
{
	asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

/* Arrives once, announcing `bytes` the phase's bulk copies (or peers' st.async) will deliver. */
__device__ __forceinline__ void mbarrier_expect(unsigned long long *bar, unsigned bytes)
{
	asm volatile(
	    "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_addr(bar)),
	    "r"(bytes)
	    : "memory");
}

__device__ __forceinline__ void mbarrier_wait(unsigned long long *bar, unsigned parity)
{
	unsigned done;
	do {
		asm volatile("{\n\t.reg .pred p;\n\t"
			     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
			     "selp.u32 %0, 1, 0, p;\n\t}"
			     : "=r"(done)
			     : "r"(shared_addr(bar)), "r"(parity)
			     : "memory");
	} while (!done);
}

/*
 * mbarrier_wait for a barrier that other blocks of the cluster complete
 * (st.async): acquire at cluster scope, so that their stores are seen.
 */
__device__ __forceinline__ void mbarrier_wait_cluster(unsigned long long *bar, unsigned parity)
{
	unsigned done;
	do {
		asm volatile(
		    "{\n\t.reg .pred p;\n\t"
		    "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
		    "selp.u32 %0, 1, 0, p;\n\t}"
		    : "=r"(done)
		    : "r"(shared_addr(bar)), "r"(parity)
		    : "memory");
	} while (!done);
}

/* `bytes` (a multiple of 16) from global to this block's shared memory. */
__device__ __forceinline__ void bulk_load(void *dst, const void *src, unsigned bytes,
					  unsigned long long *bar)
{
	asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
		     "[%0], [%1], %2, [%3];" ::"r"(shared_addr(dst)),
		     "l"(src), "r"(bytes), "r"(shared_addr(bar))
		     : "memory");
}

__device__ __forceinline__ void cluster_arrive()
{
	asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}

__device__ __forceinline__ void cluster_wait()
{
	asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

/* The address of `local` (shared memory) in the block of cluster rank `rank`. */
__device__ __forceinline__ unsigned rank_addr(const void *local, int rank)
{
	unsigned remote;
	asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
		     : "=r"(remote)
		     : "r"(shared_addr(local)), "r"(rank));
	return remote;
}

/*
 * Stores v at `local` in the block of cluster rank `rank`, completing 16
 * bytes of that block's mbarrier `bar` (its waiters then see v). Unlike a
 * release barrier, it does not wait for this thread's earlier global stores.
 */
__device__ __forceinline__ void store_to_rank(float4 *local, unsigned long long *bar, int rank,
					      float4 v)
{
	asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 "
		     "[%0], {%1, %2, %3, %4}, [%5];" ::"r"(rank_addr(local, rank)),
		     "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(rank_addr(bar, rank))
		     : "memory");
}
#endif

} /* namespace nkc */

#endif /* NORMD_NORM_CUDA_PTX_CUH */
