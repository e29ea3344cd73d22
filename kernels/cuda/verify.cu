// Hot verification kernels for speculative decoding (loaded lazily with cupy.RawModule by
// ssd/kernels/cuda/__init__.py; the torch implementation in ssd/kernels/verify.py is the reference).
//
// Layout (all contiguous, row-major):
//   draft        [B, K]      int64   (padding beyond num_draft[b] is never read as an index)
//   num_draft    [B]         int64   (already clamped to [0, K] by the caller)
//   target       [B, K+1, V] float32 (logits or probs for greedy; filtered probs p for rejection)
//   q            [B, K, V]   float32 (rejection only; ignored when has_q == 0: point-mass drafter)
//   u_accept     [B, K]      float64, u_sample [B] float64
//   num_accepted [B]         int64   (out)
//   tokens       [B, K+1]    int64   (out): accepted drafts, correction/bonus at num_accepted, then -1
//
// One thread block per batch row; blockDim.x must equal SSD_BLOCK (a multiple of 32, <= 1024).
// V need not be a multiple of the block size: every loop over V is strided with a bounds check.
// Semantics match the torch path exactly except for float64 summation order in the final
// inverse-CDF sample (block scan instead of a sequential cumsum), which can only matter when a
// uniform lands within ~1e-16 of a CDF boundary.

#ifndef SSD_BLOCK
#define SSD_BLOCK 256
#endif
#define SSD_WARPS (SSD_BLOCK / 32)
#define SSD_FULL_MASK 0xffffffffu
#define SSD_INT_MAX 2147483647
// No headers are included (NVRTC compiles this without the standard library): -inf and NaN tests
// are spelled with intrinsics / self-comparison.
#define SSD_NEG_INF __int_as_float(0xff800000)

// ------------------------------------------------------------------------------------------------
// block-wide helpers (every thread of the block must call them; results are broadcast to all)
// ------------------------------------------------------------------------------------------------

// torch.argmax order: NaN is the maximum, ties -> lowest index.
__device__ __forceinline__ bool ssd_argmax_better(float v, int i, float bv, int bi) {
    bool vn = v != v, bn = bv != bv;  // NaN
    if (vn || bn) {
        if (vn && !bn) return true;
        if (!vn && bn) return false;
        return i < bi;
    }
    return v > bv || (v == bv && i < bi);
}

__device__ int ssd_block_argmax(const float* row, int V) {
    __shared__ float s_val[SSD_WARPS];
    __shared__ int s_idx[SSD_WARPS];
    __shared__ int s_res;
    float bv = SSD_NEG_INF;
    int bi = SSD_INT_MAX;
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        float x = row[v];
        if (ssd_argmax_better(x, v, bv, bi)) { bv = x; bi = v; }
    }
    for (int off = 16; off > 0; off >>= 1) {
        float ov = __shfl_down_sync(SSD_FULL_MASK, bv, off);
        int oi = __shfl_down_sync(SSD_FULL_MASK, bi, off);
        if (oi != SSD_INT_MAX && (bi == SSD_INT_MAX || ssd_argmax_better(ov, oi, bv, bi))) { bv = ov; bi = oi; }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { s_val[warp] = bv; s_idx[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        bv = lane < SSD_WARPS ? s_val[lane] : SSD_NEG_INF;
        bi = lane < SSD_WARPS ? s_idx[lane] : SSD_INT_MAX;
        for (int off = 16; off > 0; off >>= 1) {
            float ov = __shfl_down_sync(SSD_FULL_MASK, bv, off);
            int oi = __shfl_down_sync(SSD_FULL_MASK, bi, off);
            if (oi != SSD_INT_MAX && (bi == SSD_INT_MAX || ssd_argmax_better(ov, oi, bv, bi))) { bv = ov; bi = oi; }
        }
        if (lane == 0) s_res = bi == SSD_INT_MAX ? 0 : bi;
    }
    __syncthreads();
    int res = s_res;
    __syncthreads();  // s_res may be reused by the next call
    return res;
}

__device__ double ssd_block_sum(double x) {
    __shared__ double s[SSD_WARPS];
    __shared__ double s_res;
    for (int off = 16; off > 0; off >>= 1) x += __shfl_down_sync(SSD_FULL_MASK, x, off);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) s[warp] = x;
    __syncthreads();
    if (warp == 0) {
        x = lane < SSD_WARPS ? s[lane] : 0.0;
        for (int off = 16; off > 0; off >>= 1) x += __shfl_down_sync(SSD_FULL_MASK, x, off);
        if (lane == 0) s_res = x;
    }
    __syncthreads();
    double res = s_res;
    __syncthreads();
    return res;
}

// op: 0 = max, 1 = min
__device__ int ssd_block_minmax(int x, int op) {
    __shared__ int s[SSD_WARPS];
    __shared__ int s_res;
    for (int off = 16; off > 0; off >>= 1) {
        int o = __shfl_down_sync(SSD_FULL_MASK, x, off);
        x = op == 0 ? max(x, o) : min(x, o);
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) s[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int ident = op == 0 ? -1 : SSD_INT_MAX;
        x = lane < SSD_WARPS ? s[lane] : ident;
        for (int off = 16; off > 0; off >>= 1) {
            int o = __shfl_down_sync(SSD_FULL_MASK, x, off);
            x = op == 0 ? max(x, o) : min(x, o);
        }
        if (lane == 0) s_res = x;
    }
    __syncthreads();
    int res = s_res;
    __syncthreads();
    return res;
}

// Inclusive prefix sum over the block (thread order); *total receives the block total.
__device__ double ssd_block_inclusive_scan(double x, double* total) {
    __shared__ double s[SSD_WARPS];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int off = 1; off < 32; off <<= 1) {
        double o = __shfl_up_sync(SSD_FULL_MASK, x, off);
        if (lane >= off) x += o;
    }
    if (lane == 31) s[warp] = x;
    __syncthreads();
    if (warp == 0) {
        double w = lane < SSD_WARPS ? s[lane] : 0.0;
        for (int off = 1; off < 32; off <<= 1) {
            double o = __shfl_up_sync(SSD_FULL_MASK, w, off);
            if (lane >= off) w += o;
        }
        if (lane < SSD_WARPS) s[lane] = w;  // inclusive scan of warp totals
    }
    __syncthreads();
    if (warp > 0) x += s[warp - 1];
    *total = s[SSD_WARPS - 1];
    __syncthreads();
    return x;
}

// ------------------------------------------------------------------------------------------------
// greedy verification
// ------------------------------------------------------------------------------------------------

extern "C" __global__ void ssd_verify_greedy(
    const float* __restrict__ target,      // [B, K+1, V]
    const long long* __restrict__ draft,   // [B, K]
    const long long* __restrict__ num_draft,  // [B]
    int B, int K, int V,
    long long* __restrict__ num_accepted,  // [B]
    long long* __restrict__ tokens) {      // [B, K+1]
    const int b = blockIdx.x;
    if (b >= B) return;
    __shared__ int s_stop;
    __shared__ int s_n;
    const int nd = (int)num_draft[b];
    if (threadIdx.x == 0) { s_stop = 0; s_n = nd; }
    __syncthreads();
    for (int i = 0; i <= nd; ++i) {
        const float* row = target + ((long long)b * (K + 1) + i) * V;
        int am = ssd_block_argmax(row, V);
        if (threadIdx.x == 0) {
            if (i < nd && draft[(long long)b * K + i] == (long long)am) {
                tokens[(long long)b * (K + 1) + i] = am;  // accepted draft
            } else {
                tokens[(long long)b * (K + 1) + i] = am;  // correction (i < nd) or bonus (i == nd)
                s_n = i;
                s_stop = 1;
            }
        }
        __syncthreads();
        if (s_stop) break;
    }
    const int n = s_n;
    if (threadIdx.x == 0) num_accepted[b] = n;
    for (int t = n + 1 + threadIdx.x; t < K + 1; t += blockDim.x) tokens[(long long)b * (K + 1) + t] = -1;
}

// ------------------------------------------------------------------------------------------------
// rejection-sampling verification
// ------------------------------------------------------------------------------------------------

// Mass at token v of the distribution sampled at the stop position.
__device__ __forceinline__ float ssd_final_mass(const float* prow, const float* qrow, int mode, int x, int v) {
    float pv = prow[v];
    if (mode == 0) return pv;                          // bonus, or zero-mass fallback: p itself
    if (mode == 1) return fmaxf(pv - qrow[v], 0.0f);   // residual max(0, p - q)
    return v == x ? 0.0f : pv;                         // point mass: p with x zeroed (x may be -1)
}

extern "C" __global__ void ssd_verify_rejection(
    const float* __restrict__ p,           // [B, K+1, V]
    const float* __restrict__ q,           // [B, K, V] (unused if has_q == 0)
    int has_q,
    const long long* __restrict__ draft,   // [B, K]
    const long long* __restrict__ num_draft,  // [B]
    const double* __restrict__ u_accept,   // [B, K]
    const double* __restrict__ u_sample,   // [B]
    int B, int K, int V,
    long long* __restrict__ num_accepted,  // [B]
    long long* __restrict__ tokens) {      // [B, K+1]
    const int b = blockIdx.x;
    if (b >= B) return;
    __shared__ int s_j, s_mode, s_x;
    const int nd = (int)num_draft[b];

    // 1. sequential acceptance tests (cheap: one gather per draft), thread 0 only
    if (threadIdx.x == 0) {
        int j = 0;
        int mode = 0;
        int xr = -1;
        for (; j < nd; ++j) {
            long long x = draft[(long long)b * K + j];
            bool valid_x = x >= 0 && x < V;
            double px = valid_x ? (double)p[((long long)b * (K + 1) + j) * V + x] : 0.0;
            double qx = has_q ? (valid_x ? (double)q[((long long)b * K + j) * V + x] : 0.0) : 1.0;
            if (u_accept[(long long)b * K + j] * qx < px) {
                tokens[(long long)b * (K + 1) + j] = x;
            } else {
                mode = has_q ? 1 : 2;
                xr = valid_x ? (int)x : -1;
                break;
            }
        }
        s_j = j;
        s_mode = mode;
        s_x = xr;
    }
    __syncthreads();
    const int j = s_j;
    int mode = s_mode;
    const int x = s_x;
    const float* prow = p + ((long long)b * (K + 1) + j) * V;
    const float* qrow = (has_q && j < K) ? q + ((long long)b * K + j) * V : prow;

    // 2. total mass and last positive token of the final distribution (fallback to p if zero mass)
    double sum = 0.0;
    int last = -1;
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        float r = ssd_final_mass(prow, qrow, mode, x, v);
        sum += (double)r;
        if (r > 0.0f) last = v;
    }
    last = ssd_block_minmax(last, 0);
    if (last < 0 && mode != 0) {
        mode = 0;
        sum = 0.0;
        for (int v = threadIdx.x; v < V; v += blockDim.x) {
            float r = prow[v];
            sum += (double)r;
            if (r > 0.0f) last = v;
        }
        last = ssd_block_minmax(last, 0);
    }
    const double total = ssd_block_sum(sum);
    const double target = u_sample[b] * total;

    // 3. inverse CDF: first token with cumulative mass > target and positive mass, tile by tile
    double carry = 0.0;
    int found = SSD_INT_MAX;
    for (int base = 0; base < V; base += blockDim.x) {
        int v = base + threadIdx.x;
        float r = v < V ? ssd_final_mass(prow, qrow, mode, x, v) : 0.0f;
        double tile_total;
        double cum = carry + ssd_block_inclusive_scan((double)r, &tile_total);
        int cand = (v < V && r > 0.0f && cum > target) ? v : SSD_INT_MAX;
        found = ssd_block_minmax(cand, 1);
        if (found != SSD_INT_MAX) break;
        carry += tile_total;
    }
    if (threadIdx.x == 0) {
        int tok = found != SSD_INT_MAX ? found : (last >= 0 ? last : 0);
        tokens[(long long)b * (K + 1) + j] = tok;
        num_accepted[b] = j;
    }
    for (int t = j + 1 + threadIdx.x; t < K + 1; t += blockDim.x) tokens[(long long)b * (K + 1) + t] = -1;
}
