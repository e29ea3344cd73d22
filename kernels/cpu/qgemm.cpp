// Block-quantised GEMM for CPU decoding (AVX2 + FMA + F16C): y[M, N] = x[M, K] @ W[N, K]^T.
//
// Weights come in blocks of 32 along K with fp16 scales:
//   q4: w = s * q + o, q in 0..15 (16 bytes per block: byte j = q[j] | q[j + 16] << 4)
//   q8: w = s * q,     q in -127..127 (32 bytes per block)
// Activations are quantised per row and block of 32 to int8 (xq, scale dx; Q8_0 style), so each
// block's dot product is an exact integer sum (maddubs + madd):
//   q4: y += s * dx * sum(q * xq) + o * (dx * sum(xq))        q8: y += s * dx * sum(q * xq)
//
// Row independence: every output element y[m, n] is computed by the same sequence of floating-point
// operations whatever M is and whichever rows share a chunk (the chunk only decides how many rows
// reuse one unpacked weight block). This is what lets a K+1-token verification reproduce one-token
// decoding bit for bit. Build with -ffp-contract=off so the compiler cannot fuse differently in
// different instantiations.
//
// Threads: the N outputs are split into contiguous ranges, one per OpenMP thread (the caller passes
// torch.get_num_threads(); torch's own libgomp serves the pragma, so there is one thread pool).

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

namespace {

constexpr int QK = 32;
constexpr int MAX_BLOCKS = 4096;  // K <= 131072
constexpr int MC = 8;             // rows sharing one unpacked weight block

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline void fp16_to_f32(const uint16_t* src, float* dst, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    for (; i < n; ++i) dst[i] = _cvtsh_ss(src[i]);
}

// sum_i a[i] * b[i]: 8 lanes, then the tail; a fixed order for a given n.
inline float dot_f32(const float* a, const float* b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum(acc);
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}

inline int hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

// Unsigned maddubs operands of `cnt` weight blocks starting at block b (q4: codes; q8: |q|), and for
// q8 the signed weights themselves (their signs move onto the activations).
template <bool Q4>
inline void unpack(const uint8_t* w, int b, int cnt, __m256i* wq, __m256i* sgn) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < cnt; ++j) {
        if (Q4) {
            const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (b + j) * 16));
            wq[j] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), mask);
        } else {
            sgn[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (b + j) * 32));
            wq[j] = _mm256_sign_epi8(sgn[j], sgn[j]);
        }
    }
}

// The 8 lanes of one block's integer dot product sum(q * xq) (still to be added up).
template <bool Q4>
inline __m256i block_dot(const __m256i& wq, const __m256i& sgn, const int8_t* x) {
    __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    if (!Q4) xv = _mm256_sign_epi8(xv, sgn);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(wq, xv), _mm256_set1_epi16(1));
}

// Four blocks' dot products (unpacked wq/sgn, activations x) reduced by a hadd tree: lane j of each
// 128-bit half holds a partial sum of block j; adding the two halves gives the exact block sums.
template <bool Q4>
inline __m256i quad_dot(const __m256i* wq, const __m256i* sgn, const int8_t* x) {
    const __m256i h01 = _mm256_hadd_epi32(block_dot<Q4>(wq[0], sgn[0], x), block_dot<Q4>(wq[1], sgn[1], x + 32));
    const __m256i h23 = _mm256_hadd_epi32(block_dot<Q4>(wq[2], sgn[2], x + 64), block_dot<Q4>(wq[3], sgn[3], x + 96));
    return _mm256_hadd_epi32(h01, h23);
}

// One weight row (blocks converted: sf, of) against `mc` activation rows: y[i] for each.
// Per 8 blocks: the 8 integer block sums land in one vector (hadd tree, exact), then one
// cvt + fma with the 8 block scales s * dx (and, q4, one fma with offset * sx). Tail blocks one by one.
// `pf`: a later weight row to prefetch at the pace this one is read (nullptr: none).
template <bool Q4>
inline void row_dot(const uint8_t* w, const float* sf, const float* of, const int8_t* xq, const float* dx,
                    const float* sx, int mc, int K, int nb, float* out, const uint8_t* pf) {
    __m256 acc[MC];
    for (int i = 0; i < MC; ++i) acc[i] = _mm256_setzero_ps();
    __m256i wq[8], sgn[8];
    const int nb8 = nb / 8 * 8;
    constexpr int step_bytes = 8 * (Q4 ? 16 : 32);
    for (int b = 0; b < nb8; b += 8) {
        if (pf != nullptr)
            for (int p = 0; p < step_bytes; p += 64) _mm_prefetch(reinterpret_cast<const char*>(pf) + b * (step_bytes / 8) + p, _MM_HINT_T0);
        unpack<Q4>(w, b, 8, wq, sgn);
        const __m256 s8 = _mm256_loadu_ps(sf + b);
        for (int i = 0; i < mc; ++i) {
            const int8_t* x = xq + static_cast<size_t>(i) * K + static_cast<size_t>(b) * QK;
            const __m256i lo = quad_dot<Q4>(wq, sgn, x), hi = quad_dot<Q4>(wq + 4, sgn + 4, x + 128);
            const __m256i dots = _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20),
                                                  _mm256_permute2x128_si256(lo, hi, 0x31));  // blocks b..b+7
            const size_t at = static_cast<size_t>(i) * nb + b;
            acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(s8, _mm256_loadu_ps(dx + at)), _mm256_cvtepi32_ps(dots), acc[i]);
            if (Q4) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(of + b), _mm256_loadu_ps(sx + at), acc[i]);
        }
    }
    // A tail of 4+ blocks (K = 896: 28 blocks) the same way on 4 lanes, then single blocks.
    const int nb4 = nb8 + (nb - nb8) / 4 * 4;
    __m128 acc4[MC];
    for (int i = 0; i < MC; ++i) acc4[i] = _mm_setzero_ps();
    if (nb4 > nb8) {
        if (pf != nullptr)
            for (int p = 0; p < step_bytes / 2; p += 64) _mm_prefetch(reinterpret_cast<const char*>(pf) + nb8 * (step_bytes / 8) + p, _MM_HINT_T0);
        unpack<Q4>(w, nb8, 4, wq, sgn);
        const __m128 s4 = _mm_loadu_ps(sf + nb8);
        for (int i = 0; i < mc; ++i) {
            const int8_t* x = xq + static_cast<size_t>(i) * K + static_cast<size_t>(nb8) * QK;
            const __m256i q = quad_dot<Q4>(wq, sgn, x);
            const __m128i dots = _mm_add_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
            const size_t at = static_cast<size_t>(i) * nb + nb8;
            acc4[i] = _mm_fmadd_ps(_mm_mul_ps(s4, _mm_loadu_ps(dx + at)), _mm_cvtepi32_ps(dots), acc4[i]);
            if (Q4) acc4[i] = _mm_fmadd_ps(_mm_loadu_ps(of + nb8), _mm_loadu_ps(sx + at), acc4[i]);
        }
    }
    for (int i = 0; i < mc; ++i) {
        __m128 s = _mm_add_ps(acc4[i], _mm_movehl_ps(acc4[i], acc4[i]));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        out[i] = hsum(acc[i]) + _mm_cvtss_f32(s);
    }
    for (int b = nb4; b < nb; ++b) {
        unpack<Q4>(w, b, 1, wq, sgn);
        for (int i = 0; i < mc; ++i) {
            const size_t at = static_cast<size_t>(i) * nb + b;
            const int dot = hsum_i32(block_dot<Q4>(wq[0], sgn[0], xq + static_cast<size_t>(i) * K + b * QK));
            out[i] += sf[b] * dx[at] * static_cast<float>(dot);
            if (Q4) out[i] += of[b] * sx[at];
        }
    }
}

template <bool Q4>
void gemm(const uint8_t* w, const uint16_t* scale, const uint16_t* offset, const int8_t* xq, const float* dx,
          const float* sx, int M, int N, int K, void* y, int y_bf16, int nthreads) {
    const int nb = K / QK;
    const int row_bytes = Q4 ? K / 2 : K;
#pragma omp parallel num_threads(nthreads)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int n0 = static_cast<int>(static_cast<int64_t>(N) * t / nt);
        const int n1 = static_cast<int>(static_cast<int64_t>(N) * (t + 1) / nt);
        float sf[MAX_BLOCKS], of[MAX_BLOCKS], part[MC];
        // Short rows (K ~ 1000: a few hundred bytes) leave the hardware prefetcher restarting on every
        // row, so each row also prefetches one ~8 KiB further on (and its scales), as the dense kernel does.
        const int ahead = row_bytes >= 8192 ? 1 : 8192 / row_bytes;
        for (int n = n0; n < n1; ++n) {
            const uint8_t* pf = n + ahead < N ? w + static_cast<size_t>(n + ahead) * row_bytes : nullptr;
            if (pf != nullptr) {
                const size_t at = static_cast<size_t>(n + ahead) * nb;
                for (int p = 0; p < nb * 2; p += 64) {
                    _mm_prefetch(reinterpret_cast<const char*>(scale + at) + p, _MM_HINT_T0);
                    if (Q4) _mm_prefetch(reinterpret_cast<const char*>(offset + at) + p, _MM_HINT_T0);
                }
            }
            fp16_to_f32(scale + static_cast<size_t>(n) * nb, sf, nb);
            if (Q4) fp16_to_f32(offset + static_cast<size_t>(n) * nb, of, nb);
            const uint8_t* wr = w + static_cast<size_t>(n) * row_bytes;
            for (int m0 = 0; m0 < M; m0 += MC) {
                const int mc = M - m0 < MC ? M - m0 : MC;
                row_dot<Q4>(wr, sf, of, xq + static_cast<size_t>(m0) * K, dx + static_cast<size_t>(m0) * nb,
                            Q4 ? sx + static_cast<size_t>(m0) * nb : nullptr, mc, K, nb, part, m0 == 0 ? pf : nullptr);
                for (int i = 0; i < mc; ++i) {
                    const size_t at = static_cast<size_t>(m0 + i) * N + n;
                    if (y_bf16)
                        static_cast<uint16_t*>(y)[at] = f32_to_bf16(part[i]);
                    else
                        static_cast<float*>(y)[at] = part[i];
                }
            }
        }
    }
}


// -- dense GEMM: fp32 or bf16 weights, fp32 accumulation -------------------------------------------
//
// y[m, n] = bias[n] + sum_k x[m, k] * w[n, k] with one 8-lane fp32 accumulator per output, k in steps
// of 8 (fp32 weights) or 16 (bf16), then hsum, then the k tail: a fixed order for a given K, so every
// output row gets the same bits whatever M is (batch invariant). NR weight rows x MR activation rows
// share one pass over K; that grouping changes how often a weight vector is loaded, never an output's
// arithmetic.
//
// bf16 weights without shuffles: 16 bf16 loaded as 8 int32 give the even elements as fp32 by a
// left shift of 16 and the odd ones by masking the low half, so x is stored de-interleaved per
// 16 (8 even, then 8 odd; see deinterleave16) and each 16 weights cost a load, a shift and an and.

constexpr int DK_BF16 = 16;
constexpr int DK_F32 = 8;

// Row of K activations -> fp32 in the order dense_tile reads it (bf16 weights: de-interleaved per 16).
template <bool WBF16>
inline void prepare_x_row(const void* x, int x_bf16, size_t at, int K, float* dst) {
    for (int k = 0; k < K; ++k)
        dst[k] = x_bf16 ? bf16_to_f32(static_cast<const uint16_t*>(x)[at + k]) : static_cast<const float*>(x)[at + k];
    if (WBF16) {
        float tmp[DK_BF16];
        for (int k = 0; k + DK_BF16 <= K; k += DK_BF16) {
            for (int j = 0; j < 8; ++j) {
                tmp[j] = dst[k + 2 * j];
                tmp[8 + j] = dst[k + 2 * j + 1];
            }
            memcpy(dst + k, tmp, sizeof(tmp));
        }
    }
}

template <bool WBF16>
inline float load_w1(const void* w, size_t at) {
    return WBF16 ? bf16_to_f32(static_cast<const uint16_t*>(w)[at]) : static_cast<const float*>(w)[at];
}

// Outputs n0..n0+NR-1 for activation rows m0..m0+MR-1 (xf: prepared fp32 [M, K]) into out[i * NR + j].
template <bool WBF16, int NR, int MR>
inline void dense_tile(const void* w, const float* xf, int n0, int m0, int K, float* out) {
    constexpr int DK = WBF16 ? DK_BF16 : DK_F32;
    __m256 acc[MR][NR];
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
    const int Kv = K / DK * DK;
    const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    // The next tile's weights (contiguous, right after this tile's NR rows) are prefetched at the
    // rate this tile consumes its own: short rows (K ~ 1000) otherwise leave the hardware
    // prefetcher restarting on every row and the stream well below the memory bandwidth.
    const char* next = reinterpret_cast<const char*>(w) + static_cast<size_t>(n0 + NR) * K * (WBF16 ? 2 : 4);
    constexpr int step_bytes = NR * DK * (WBF16 ? 2 : 4);
    for (int k = 0; k < Kv; k += DK) {
        for (int p = 0; p < step_bytes; p += 64) _mm_prefetch(next + static_cast<size_t>(k / DK) * step_bytes + p, _MM_HINT_T0);
        if (WBF16) {
            __m256 xe[MR], xo[MR];
            for (int i = 0; i < MR; ++i) {
                xe[i] = _mm256_loadu_ps(xf + static_cast<size_t>(m0 + i) * K + k);
                xo[i] = _mm256_loadu_ps(xf + static_cast<size_t>(m0 + i) * K + k + 8);
            }
            for (int j = 0; j < NR; ++j) {
                const __m256i raw = _mm256_loadu_si256(
                    reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w) + static_cast<size_t>(n0 + j) * K + k));
                const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
                const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(raw, hi_mask));
                for (int i = 0; i < MR; ++i) {
                    acc[i][j] = _mm256_fmadd_ps(we, xe[i], acc[i][j]);
                    acc[i][j] = _mm256_fmadd_ps(wo, xo[i], acc[i][j]);
                }
            }
        } else {
            __m256 xv[MR];
            for (int i = 0; i < MR; ++i) xv[i] = _mm256_loadu_ps(xf + static_cast<size_t>(m0 + i) * K + k);
            for (int j = 0; j < NR; ++j) {
                const __m256 wv = _mm256_loadu_ps(static_cast<const float*>(w) + static_cast<size_t>(n0 + j) * K + k);
                for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_fmadd_ps(wv, xv[i], acc[i][j]);
            }
        }
    }
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) {
            float s = hsum(acc[i][j]);
            for (int k = Kv; k < K; ++k)
                s += load_w1<WBF16>(w, static_cast<size_t>(n0 + j) * K + k) * xf[static_cast<size_t>(m0 + i) * K + k];
            out[i * NR + j] = s;
        }
}

template <bool WBF16, int NR, int MR>
inline void dense_rows(const void* w, const float* xf, int n0, int n1, int M, int K, const float* bias, void* y,
                       int y_bf16, int N) {
    float part[MR * NR];
    auto emit = [&](int nn, int m, float v) {
        if (bias != nullptr) v += bias[nn];
        const size_t at = static_cast<size_t>(m) * N + nn;
        if (y_bf16)
            static_cast<uint16_t*>(y)[at] = f32_to_bf16(v);
        else
            static_cast<float*>(y)[at] = v;
    };
    int n = n0;
    for (; n + NR <= n1; n += NR) {
        int m = 0;
        for (; m + MR <= M; m += MR) {
            dense_tile<WBF16, NR, MR>(w, xf, n, m, K, part);
            for (int i = 0; i < MR; ++i)
                for (int j = 0; j < NR; ++j) emit(n + j, m + i, part[i * NR + j]);
        }
        for (; m < M; ++m) {
            dense_tile<WBF16, NR, 1>(w, xf, n, m, K, part);
            for (int j = 0; j < NR; ++j) emit(n + j, m, part[j]);
        }
    }
    for (; n < n1; ++n)
        for (int m = 0; m < M; ++m) {
            dense_tile<WBF16, 1, 1>(w, xf, n, m, K, part);
            emit(n, m, part[0]);
        }
}

template <bool WBF16>
void dense_gemm(const void* w, const float* xf, const float* bias, int M, int N, int K, void* y, int y_bf16,
                int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        // Split N in multiples of 8 so every thread keeps whole tiles.
        const int tiles = (N + 7) / 8;
        int n0 = static_cast<int>(static_cast<int64_t>(tiles) * t / nt) * 8;
        int n1 = static_cast<int>(static_cast<int64_t>(tiles) * (t + 1) / nt) * 8;
        n0 = n0 < N ? n0 : N;
        n1 = n1 < N ? n1 : N;
        if (M == 1)
            dense_rows<WBF16, 8, 1>(w, xf, n0, n1, M, K, bias, y, y_bf16, N);
        else
            dense_rows<WBF16, 4, 2>(w, xf, n0, n1, M, K, bias, y, y_bf16, N);
    }
}

}  // namespace

extern "C" {

int ssd_qgemm_max_blocks() { return MAX_BLOCKS; }

// x [M, K] (fp32, or bf16 when x_bf16) -> xq int8 [M, K], dx = absmax / 127 and sx = dx * sum(xq) per
// (row, block) [M, K / 32]. xq = round_half_even(x * (1 / dx)); an all-zero block gives dx = 0, xq = 0.
void ssd_quantize_rows(const void* x, int x_bf16, int M, int K, int8_t* xq, float* dx, float* sx) {
    const int nb = K / QK;
    for (int m = 0; m < M; ++m) {
        for (int b = 0; b < nb; ++b) {
            float v[QK];
            const size_t at = static_cast<size_t>(m) * K + static_cast<size_t>(b) * QK;
            for (int j = 0; j < QK; ++j)
                v[j] = x_bf16 ? bf16_to_f32(static_cast<const uint16_t*>(x)[at + j]) : static_cast<const float*>(x)[at + j];
            float amax = 0.0f;
            for (int j = 0; j < QK; ++j) {
                const float a = v[j] < 0 ? -v[j] : v[j];
                amax = a > amax ? a : amax;
            }
            const float d = amax / 127.0f;
            const float id = d != 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int j = 0; j < QK; j += 8) {
                const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v + j), _mm256_set1_ps(id)),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                alignas(32) int32_t qi[8];
                _mm256_store_si256(reinterpret_cast<__m256i*>(qi), _mm256_cvtps_epi32(r));
                for (int k = 0; k < 8; ++k) {
                    xq[at + j + k] = static_cast<int8_t>(qi[k]);
                    sum += qi[k];
                }
            }
            dx[static_cast<size_t>(m) * nb + b] = d;
            sx[static_cast<size_t>(m) * nb + b] = d * static_cast<float>(sum);
        }
    }
}

// y [M, N] = x [M, K] @ W^T: quantise x's rows (as ssd_quantize_rows), then the block GEMM.
// x and y share one dtype (bf16 when bf16, else fp32). offset == nullptr: q8 weights, else q4.
void ssd_linear(const void* x, int M, int N, int K, const uint8_t* w, const uint16_t* scale,
                const uint16_t* offset, void* y, int bf16, int nthreads) {
    const size_t nb = static_cast<size_t>(K) / QK;
    int8_t* xq = static_cast<int8_t*>(malloc(static_cast<size_t>(M) * K));
    float* dx = static_cast<float*>(malloc(sizeof(float) * M * nb));
    float* sx = static_cast<float*>(malloc(sizeof(float) * M * nb));
    ssd_quantize_rows(x, bf16, M, K, xq, dx, sx);
    if (offset != nullptr)
        gemm<true>(w, scale, offset, xq, dx, sx, M, N, K, y, bf16, nthreads);
    else
        gemm<false>(w, scale, nullptr, xq, dx, nullptr, M, N, K, y, bf16, nthreads);
    free(xq);
    free(dx);
    free(sx);
}

// out = weight * rmsnorm(x) per row of D: fp32 mean of squares, x * rsqrt(ms + eps) rounded to the
// dtype, then times the weight (as workers/models/decoder.RMSNorm does in torch).
void ssd_rmsnorm(const void* x, const void* weight, void* out, int bf16, int M, int D, float eps) {
    float* row = static_cast<float*>(malloc(sizeof(float) * D));
    for (int m = 0; m < M; ++m) {
        const size_t at = static_cast<size_t>(m) * D;
        for (int d = 0; d < D; ++d)
            row[d] = bf16 ? bf16_to_f32(static_cast<const uint16_t*>(x)[at + d]) : static_cast<const float*>(x)[at + d];
        const float r = 1.0f / sqrtf(dot_f32(row, row, D) / static_cast<float>(D) + eps);
        for (int d = 0; d < D; ++d) {
            if (bf16) {
                const float normed = bf16_to_f32(f32_to_bf16(row[d] * r));
                const float wd = bf16_to_f32(static_cast<const uint16_t*>(weight)[d]);
                static_cast<uint16_t*>(out)[at + d] = f32_to_bf16(wd * normed);
            } else {
                static_cast<float*>(out)[at + d] = static_cast<const float*>(weight)[d] * (row[d] * r);
            }
        }
    }
    free(row);
}

// Attention for new tokens one at a time, each over exactly the cache positions it may see (no mask):
// out[r, h] = softmax(q[r, h] . k[pos] / sqrt(hd)) @ v[pos] over pos in 0..len[r]-1, or over
// idx[off[r] .. off[r] + len[r]) when off[r] >= 0 (tree tokens). q: [R, H, hd] with row stride
// q_stride (elements), out: [R, H, hd] contiguous; caches: one
// layer [S, Hkv, max_len, hd]; q, caches and out share one dtype (bf16 or fp32); math in fp32.
// One token's result depends on its own query and keys only, so it is batch invariant.
void ssd_attend_rows(const void* q, int64_t q_stride, const void* kc, const void* vc, void* out, int bf16, int R,
                     int H, int Hkv, int hd, int max_len, const int32_t* slot, const int32_t* len, const int64_t* off,
                     const int64_t* idx, int nthreads) {
    const int group = H / Hkv;
    const float scale = 1.0f / sqrtf(static_cast<float>(hd));
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int job = 0; job < R * Hkv; ++job) {
        const int r = job / Hkv, kvh = job % Hkv;
        const int L = len[r];
        float* buf = new float[static_cast<size_t>(group) * (2 * hd + L) + hd];
        float* qf = buf;                                    // [group, hd]
        float* sc = buf + static_cast<size_t>(group) * hd;  // [group, L]
        float* acc = sc + static_cast<size_t>(group) * L;   // [group, hd]
        float* row = acc + static_cast<size_t>(group) * hd; // [hd]: one key / value row in fp32
        auto load = [&](const void* base, size_t at, float* dst) {
            if (bf16) {
                const uint16_t* p = static_cast<const uint16_t*>(base) + at;
                for (int d = 0; d < hd; ++d) dst[d] = bf16_to_f32(p[d]);
            } else {
                memcpy(dst, static_cast<const float*>(base) + at, sizeof(float) * hd);
            }
        };
        for (int g = 0; g < group; ++g)
            load(q, static_cast<size_t>(r) * q_stride + static_cast<size_t>(kvh * group + g) * hd, qf + g * hd);
        const size_t head_base = (static_cast<size_t>(slot[r]) * Hkv + kvh) * max_len;
        auto pos_of = [&](int l) -> size_t { return off[r] < 0 ? l : static_cast<size_t>(idx[off[r] + l]); };
        for (int l = 0; l < L; ++l) {
            load(kc, (head_base + pos_of(l)) * hd, row);
            for (int g = 0; g < group; ++g) sc[g * L + l] = dot_f32(qf + g * hd, row, hd) * scale;
        }
        for (int g = 0; g < group; ++g) {
            float* s = sc + static_cast<size_t>(g) * L;
            float mx = -INFINITY;
            for (int l = 0; l < L; ++l) mx = s[l] > mx ? s[l] : mx;
            float sum = 0.0f;
            for (int l = 0; l < L; ++l) {
                s[l] = expf(s[l] - mx);
                sum += s[l];
            }
            const float inv = 1.0f / sum;
            for (int l = 0; l < L; ++l) s[l] *= inv;
        }
        memset(acc, 0, sizeof(float) * group * hd);
        for (int l = 0; l < L; ++l) {
            load(vc, (head_base + pos_of(l)) * hd, row);
            for (int g = 0; g < group; ++g) {
                const float p = sc[static_cast<size_t>(g) * L + l];
                float* a = acc + static_cast<size_t>(g) * hd;
                for (int d = 0; d < hd; ++d) a[d] += p * row[d];
            }
        }
        for (int g = 0; g < group; ++g) {
            const size_t at = (static_cast<size_t>(r) * H + kvh * group + g) * hd;
            for (int d = 0; d < hd; ++d) {
                if (bf16)
                    static_cast<uint16_t*>(out)[at + d] = f32_to_bf16(acc[g * hd + d]);
                else
                    static_cast<float*>(out)[at + d] = acc[g * hd + d];
            }
        }
        delete[] buf;
    }
}

// y [M, N] = x [M, K] @ w[N, K]^T (+ bias [N]): w fp32, or bf16 when w_bf16 (bias in w's dtype); x and
// y share one dtype (bf16 when x_bf16). Math in fp32, rounded to y's dtype once per output.
void ssd_linear_dense(const void* x, int x_bf16, int M, int N, int K, const void* w, int w_bf16, const void* bias,
                      void* y, int nthreads) {
    float* xf = static_cast<float*>(malloc(sizeof(float) * static_cast<size_t>(M) * K + 32));
    for (int m = 0; m < M; ++m) {
        const size_t at = static_cast<size_t>(m) * K;
        if (w_bf16)
            prepare_x_row<true>(x, x_bf16, at, K, xf + at);
        else
            prepare_x_row<false>(x, x_bf16, at, K, xf + at);
    }
    float* bf = nullptr;
    if (bias != nullptr) {
        bf = static_cast<float*>(malloc(sizeof(float) * N));
        for (int n = 0; n < N; ++n) bf[n] = w_bf16 ? load_w1<true>(bias, n) : load_w1<false>(bias, n);
    }
    if (w_bf16)
        dense_gemm<true>(w, xf, bf, M, N, K, y, x_bf16, nthreads);
    else
        dense_gemm<false>(w, xf, bf, M, N, K, y, x_bf16, nthreads);
    free(xf);
    free(bf);
}

}  // extern "C"
