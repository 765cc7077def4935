// One GEMV y = W x (W [N, K] bf16 row-major, x [K] bf16, y [N] bf16) after a window of grid-wide barriers, in one
// persistent kernel: the question of benchmarks/smem_preload_bench.py (issue 7, MoE target 1). Each CTA owns R
// contiguous rows of W (R * K * 2 bytes, one contiguous span). MODE:
//   0  the GEMV reads W from global memory after the window (what a kernel boundary leaves);
//   1  each CTA copies its rows into shared memory with cp.async before the window, and the GEMV reads them there;
//   2  each thread loads its share of the rows into registers before the window (what Triton could express);
//   3  the window alone, no GEMV (the baseline the others are charged against);
//   4  one thread copies the CTA's rows into shared memory with TMA bulk copies (cp.async.bulk, completing on an
//      mbarrier) before the window: the copy engine's path, not the load/store units' (the third run's question:
//      do the preload's loads hold the window's own loads and atomics back in the SM's memory pipeline?);
//   5  mode 4's copies paced across the window: the control thread issues copy c at the start of the first phase w
//      with (c + 1) * window <= (w + 1) * CHUNKS (every copy issued by the last phase; all at once for no window), so
//      the weight streams in at the window's pace and not in one 16.8 MB burst (the eighteenth session's question:
//      does a paced stream still push the window back?).
// The window runs on one thread of the control warp, which issues no weight loads, and the worker warps meet it at
// one __syncthreads after the window. In the first run every warp took part in each barrier's __syncthreads and
// thread 0 (a loading warp's) ran its fence; that was suspected of making the window wait for the preload. The
// control warp did not change the result, nor did the barrier kinds: the stamps showed the preload pushing the
// window's end back by 2.8-4.1 us in every preloading mode, TMA's too, as the window's requests wait behind it in
// the memory system (docs/PERF.md, seventeenth session).
// No includes: bf16 travels as unsigned short, so NVRTC needs no header.

#ifndef K
#define K 4096
#endif
#ifndef R
#define R 16
#endif
#define WARPS 8                     // the warps that load and multiply
#define THREADS (WARPS * 32 + 32)  // and one more, the control warp: the window's ticks and barriers
#define CTL (WARPS * 32)
#define RW (R / WARPS)              // rows a warp
#define V (K / 8 / 32)              // 16-byte vectors a lane a row
#define BULK 16384                  // bytes a TMA bulk copy (modes 4, 5)
#define CHUNKS (R * K * 2 / BULK)   // bulk copies a CTA
static_assert(K % 256 == 0, "a lane reads whole 16-byte vectors of every row");
static_assert(R % WARPS == 0, "every worker warp takes the same rows");
static_assert((R * K * 2) % BULK == 0 && R * K * 2 < (1 << 20), "whole bulk copies, within an mbarrier's count");

typedef unsigned short bf16;

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ unsigned ld_relaxed(const unsigned* p) {
    unsigned v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Generation barrier over the grid, run by one thread a CTA (every CTA resident): bar[0] counts arrivals, bar[1] is
// the generation. The generation is read before arriving, and the last arrival zeroes the count before it bumps the
// generation, so it needs no reset between launches or graph replays.
// KIND asks the third run's question, whether the barrier's memory ordering waits for the SM's preload:
//   bit 1 drops the release fences (__threadfence: a MEMBAR.SC.GPU and a CCTL.IVALL, an invalidation of L1);
//   bit 4 uses fence.acq_rel.gpu for them instead (a MEMBAR.ALL.GPU);
//   bit 2 spins with relaxed loads instead of acquire loads (each acquire load is followed by a CCTL.IVALL).
// Kinds 1, 2 and 3 do not order the ticks by the memory model; the benchmark checks every kind's values and reports
// a kind whose window came out wrong.
__device__ __forceinline__ unsigned ld_gen(const unsigned* p, int kind) {
    return (kind & 2) ? ld_relaxed(p) : ld_acquire(p);
}

__device__ __forceinline__ void release(int kind) {
    if (kind & 4)
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
    else if (!(kind & 1))
        __threadfence();
}

__device__ __forceinline__ void grid_barrier(unsigned* bar, int kind) {
    unsigned gen = ld_gen(bar + 1, kind);
    release(kind);
    if (atomicAdd(bar, 1u) == gridDim.x - 1) {
        atomicExch(bar, 0u);
        release(kind);
        atomicAdd(bar + 1, 1u);
    } else {
        while (ld_gen(bar + 1, kind) == gen) {
        }
    }
}

__device__ __forceinline__ unsigned long long now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) :: "memory");     // not moved past loads or stores
    return t;
}

// Waits until the mbarrier at shared address mb completes its phase 0 (mode 4's or 5's bulk copies all landed).
__device__ __forceinline__ void mbar_wait(unsigned mb) {
    unsigned done = 0;
    while (!done)
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n"
                     " selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(mb) : "memory");
}

__device__ __forceinline__ unsigned shared_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// Modes 4 and 5: the CTA's mbarrier set up for one arrival and the whole span's bytes (one thread).
__device__ __forceinline__ void tma_init(unsigned long long* mbar) {
    const unsigned mb = shared_addr(mbar);
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(mb) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(mb), "r"(R * K * 2) : "memory");
}

// Bulk copy c of the CTA's span (BULK bytes) into shared memory, completing on the mbarrier.
__device__ __forceinline__ void tma_chunk(uint4* smem, const uint4* wg, unsigned long long* mbar, int c) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(shared_addr(smem) + c * BULK), "l"(reinterpret_cast<const char*>(wg) + (size_t)c * BULK),
                    "r"(BULK), "r"(shared_addr(mbar)) : "memory");
}

__device__ __forceinline__ float lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ float dot8(uint4 a, uint4 b, float acc) {
    acc = fmaf(lo(a.x), lo(b.x), acc); acc = fmaf(hi(a.x), hi(b.x), acc);
    acc = fmaf(lo(a.y), lo(b.y), acc); acc = fmaf(hi(a.y), hi(b.y), acc);
    acc = fmaf(lo(a.z), lo(b.z), acc); acc = fmaf(hi(a.z), hi(b.z), acc);
    acc = fmaf(lo(a.w), lo(b.w), acc); acc = fmaf(hi(a.w), hi(b.w), acc);
    return acc;
}

__device__ __forceinline__ bf16 to_bf16(float f) {      // round to nearest even (finite inputs)
    unsigned u = __float_as_uint(f);
    return (bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
preload_gemv(const bf16* __restrict__ W, const bf16* __restrict__ x, bf16* __restrict__ y, unsigned* bar,
             float* tick, int window, int mode, int kind, unsigned long long* stamp) {
    extern __shared__ uint4 smem[];                 // R * K * 2 bytes (read in modes 1, 4, 5; allocated in every mode)
    __shared__ __align__(8) unsigned long long mbar;    // mode 4's or 5's copies complete on it
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t r0 = (size_t)blockIdx.x * R;
    const uint4* wg = reinterpret_cast<const uint4*>(W + r0 * K);
    uint4 reg[RW][V];
    // stamps a CTA (globaltimer, ns), where the benchmark asks where the time after the window goes: 0 entry,
    // 1 thread 0's preload issued, 2 thread 0's preload landed (modes 1, 4; in mode 5 the control thread's last
    // copy issued, and every copy landed, seen after the window's end; the eighteenth session's run stamped the
    // issue after the window too), 3 the window's end (control warp),
    // 4 thread 0's row stored. (No stamp after the workers' __syncthreads: its BAR.SYNC.DEFER_BLOCKING lets the
    // warp read the timer before the barrier opens, so the first run's stamp there read 0.26 us.)
    unsigned long long* st = stamp + blockIdx.x * 5;
    if (threadIdx.x == 0)
        st[0] = now();
    if (mode == 1) {
        const unsigned s = shared_addr(smem);
        for (int i = threadIdx.x; i < R * K / 8 && threadIdx.x < CTL; i += CTL)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(s + 16u * i), "l"(wg + i) : "memory");
        asm volatile("cp.async.commit_group;" ::: "memory");
        if (threadIdx.x == 0)
            st[1] = now();
        asm volatile("cp.async.wait_all;" ::: "memory");    // the workers wait for their copies during the window
        if (threadIdx.x == 0)
            st[2] = now();
    } else if (mode == 4 && threadIdx.x == 0) {
        tma_init(&mbar);
        for (int c = 0; c < CHUNKS; ++c)
            tma_chunk(smem, wg, &mbar, c);
        st[1] = now();
        mbar_wait(shared_addr(&mbar));
        st[2] = now();
    } else if (mode == 2 && warp < WARPS) {
#pragma unroll
        for (int j = 0; j < RW; ++j)
#pragma unroll
            for (int v = 0; v < V; ++v)
                reg[j][v] = __ldg(wg + (size_t)(warp * RW + j) * (K / 8) + v * 32 + lane);
        if (threadIdx.x == 0)
            st[1] = now();
    }
    if (threadIdx.x == CTL) {
        int c = 0;                              // mode 5: the next bulk copy to issue, and when the last went out
        unsigned long long issued = 0;          // (a register: no stamp store on the window's chain)
        if (mode == 5)
            tma_init(&mbar);
        for (int w = 0; w < window; ++w) {      // a dependent tick across CTAs, then the barrier
            for (; mode == 5 && c < CHUNKS && (c + 1) * window <= (w + 1) * CHUNKS; ++c) {
                tma_chunk(smem, wg, &mbar, c);
                issued = now();
            }
            const float* src = tick + (w & 1) * gridDim.x;
            float* dst = tick + ((w + 1) & 1) * gridDim.x;
            dst[blockIdx.x] = __ldcg(src + (blockIdx.x + 1) % gridDim.x) * 0.5f + 1.0f;
            grid_barrier(bar, kind);
        }
        st[3] = now();
        if (mode == 5) {
            for (; c < CHUNKS; ++c) {           // none left after a window; every copy without one
                tma_chunk(smem, wg, &mbar, c);
                issued = now();
            }
            st[1] = issued;
            mbar_wait(shared_addr(&mbar));
            st[2] = now();
        }
    }
    __syncthreads();                        // the workers meet the window's end once (and every cp.async landed)
    if (mode == 3)
        return;
    if (warp == WARPS)
        return;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
#pragma unroll
    for (int j = 0; j < RW; ++j) {
        const int r = warp * RW + j;
        if (mode == 0) {
#pragma unroll
            for (int v = 0; v < V; ++v)
                reg[j][v] = __ldcs(wg + (size_t)r * (K / 8) + v * 32 + lane);
        } else if (mode == 1 || mode >= 4) {
#pragma unroll
            for (int v = 0; v < V; ++v)
                reg[j][v] = smem[r * (K / 8) + v * 32 + lane];
        }
    }
    float acc[RW];
#pragma unroll
    for (int j = 0; j < RW; ++j) {
        acc[j] = 0.f;
#pragma unroll
        for (int v = 0; v < V; ++v)
            acc[j] = dot8(reg[j][v], __ldg(xv + v * 32 + lane), acc[j]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
        if (lane == 0)
            y[r0 + warp * RW + j] = to_bf16(acc[j]);
    }
    if (threadIdx.x == 0)
        st[4] = now();
}
