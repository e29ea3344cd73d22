// Shared by the CPU kernel sources: bf16 conversions (as torch does them) and the C entry points one
// source calls in another (all compiled into one library by ssd.kernels.cpu).
#pragma once

#include <immintrin.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>

#include <atomic>

inline float bf16_to_f32(uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch's .to(torch.bfloat16)
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

// One activation element of a bf16 (bf16 != 0) or fp32 buffer, as fp32; and back, rounded.
inline float act_load(const void* p, size_t i, int bf16) {
    return bf16 ? bf16_to_f32(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

inline void act_store(void* p, size_t i, float v, int bf16) {
    if (bf16)
        static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
    else
        static_cast<float*>(p)[i] = v;
}

// 8 floats rounded to bf16 and back, exactly as f32_to_bf16 (nearest even; NaNs stay quiet NaNs).
inline __m256 round_bf16_8(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i r = _mm256_blendv_epi8(rounded, _mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), nan);
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// 8 activations from `at` of a bf16 / fp32 buffer as fp32 (bf16: the bits shifted up, exact); load8 stores them.
inline __m256 load8v(const void* p, int64_t at, int bf16) {
    if (bf16) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + at));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps(static_cast<const float*>(p) + at);
}
inline void load8(const void* p, int64_t at, int bf16, float* dst) { _mm256_storeu_ps(dst, load8v(p, at, bf16)); }

// dst[0..7] = x rounded to bf16 (f32_to_bf16's bits, 8 at a time).
inline void store_bf16_8(uint16_t* dst, __m256 x) {
    const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(round_bf16_8(x)), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)));
}

// exp(x) for 8 floats (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, times 2^n), x clamped to
// [-87.3, 88.4] so 2^n stays a normal float. Explicit FMAs and -ffp-contract=off: the same bits in the
// AVX2 and AVX-512 builds.
inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3365447505f)), _mm256_set1_ps(88.3762626647949f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts: exact n * hi
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2n));
}

// A barrier for the threads of one OpenMP region that share a forward's stages (ssd_decoder_layers). libgomp's
// own barriers spin only ~100 times before sleeping in the kernel whenever the process has more OpenMP threads
// than CPUs (one more thread that ever ran a parallel region is enough: a second worker thread, or torch work on
// the main thread), and then every stage paid a sleep and a wake-up: a 1.5B decode step took 41 ms instead of
// 31 here. This one spins, then yields, so a thread sharing its core still lets the other run.
class SpinBarrier {
  public:
    explicit SpinBarrier(int n) : n_(n) {}
    void wait() {
        const int gen = gen_.load(std::memory_order_acquire);
        if (arrived_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
            arrived_.store(0, std::memory_order_relaxed);
            gen_.store(gen + 1, std::memory_order_release);
            return;
        }
        for (int spins = 0; gen_.load(std::memory_order_acquire) == gen; ++spins) {
            if (spins < 4096)
                _mm_pause();
            else
                sched_yield();
        }
    }

  private:
    const int n_;
    std::atomic<int> arrived_{0}, gen_{0};
};

// Thread t of the nt threads running one forward's stages; sync() waits for all of them.
struct Team {
    int t, nt;
    SpinBarrier* barrier;
    void sync() const {
        if (nt > 1) barrier->wait();
    }
};

namespace ssd_team {
// Linear layers run by a team: every thread calls with the same arguments and `shared` (one pointer all
// of them see, through which thread 0 hands out the prepared activations); each computes its share of
// y's columns. They return with y complete and the team in step. `linears`: block linears sharing the input
// x [M, K], each into its y [M, n] with rows ldy elements apart (q, k and v straight into their columns of one
// buffer); x quantised once per linear, the threads' shares of every linear back to back, one wait at the end.
struct TeamLinear {
    int fmt, n;
    const uint8_t* w;
    const uint16_t* scale;
    const uint16_t* offset;  // q4 only
    void* y;
    int ldy;
};
constexpr int MAX_TEAM_LINEARS = 3;
void linears(const Team& tm, void** shared, const void* x, int M, int K, const TeamLinear* ls, int count, int bf16);
void linear_dense(const Team& tm, void** shared, const void* x, int x_bf16, int M, int N, int K, const void* w,
                  int w_bf16, const void* bias, void* y);
}  // namespace ssd_team

extern "C" {
void attend_rows_part(const void* q, int64_t q_stride, const void* kc, const void* vc, void* out, int bf16, int R,
                      int H, int Hkv, int hd, int max_len, const int32_t* slot, const int32_t* len, const int64_t* off,
                      const int64_t* idx, int t, int nt);
void ssd_linear(const void* x, int M, int N, int K, const uint8_t* w, const uint16_t* scale, const uint16_t* offset,
                int fmt, void* y, int bf16, int nthreads);
void ssd_linear_dense(const void* x, int x_bf16, int M, int N, int K, const void* w, int w_bf16, const void* bias,
                      void* y, int nthreads);
void ssd_rmsnorm(const void* x, const void* weight, void* out, int bf16, int M, int D, float eps);
void ssd_attend_rows(const void* q, int64_t q_stride, const void* kc, const void* vc, void* out, int bf16, int R,
                     int H, int Hkv, int hd, int max_len, const int32_t* slot, const int32_t* len, const int64_t* off,
                     const int64_t* idx, int nthreads);
}
