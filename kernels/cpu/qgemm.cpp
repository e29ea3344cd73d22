// Block-quantised GEMM for CPU decoding (AVX2 + FMA + F16C; AVX-VNNI or AVX-512 VNNI where present):
// y[M, N] = x[M, K] @ W[N, K]^T.
//
// Weights come in blocks of 32 along K with fp16 scales (formats numbered as SsdLinear.kind):
//   q4 (1): w = s * q + o,    q in 0..15, rows in tiles of 8 (below)
//   q8 (2): w = s * q,        q in -127..127, in q4's tiles as whole bytes q + 128 (256 bytes per tile
//           and block: vector v holds codes 4v..4v+3 of row r at bytes 4r..4r+3)
//   q5 (3): w = s * (q - 16), q in 0..31 (GGUF Q5_0): q4's tiles plus a plane of fifth bits
//   q6 (4): w = s * (q - 32), q in 0..63, a scale per 16 weights (GGUF Q6_K): q4's tiles plus two
//           planes of high bits
//   q4g64 (5): q4 with one scale and offset per 64 weights (two blocks): q4's tiles, half its scales
//           (4.5 bits a weight against 5; the integer sums and float steps stay per block of 32, so an
//           output is bit for bit a q4 layer's whose two blocks of a group repeat the group's scale and offset)
// Activations are quantised per row and block of 32 to int8 (xq, scale dx; Q8_0 style), so each
// block's dot product is an exact integer sum (maddubs + madd):
//   q4: y += s * dx * sum(q * xq) + o * (dx * sum(xq))
//   q5, q8: y += s * dx * sum((q - c) * xq)
//   q6: y += dx * (s0 * sum((q - c) * xq over the first 16) + s1 * (the same over the second 16))
// with c = 16 (q5), 32 (q6), 128 (q8's stored u = q + 128 with VNNI; 0 without): the integer sums start at
// -c * sum(xq) of their block or half block (QActs::start), so no float step handles an offset.
//
// q4, q5 and q6 interleave 8 weight rows (a tile; N is zero-padded to whole tiles) so that no lane
// sums are needed: per tile and block, 128 bytes of nibbles in 4 chunks, where bytes 4r..4r+3 of
// chunk c hold row r's codes 8c+j (low nibble) and 8c+4+j (high nibble), j = 0..3. q5 adds 32 bytes
// whose bit v of byte i is bit 4 of byte i of unpacked vector v (v = 2c: chunk c's low nibbles,
// 2c + 1: its high ones); q6 adds 64: bits 2(v % 4) and 2(v % 4) + 1 of byte i of the second 32
// bytes' half v / 4 are bits 4 and 5 of that byte. High bits are moved into place by a shift, an
// and and an or per vector. A maddubs of one unpacked vector with 4 activations broadcast to every
// lane adds 2 products per int16 lane; the maddubs add up in int16 and are widened by a madd
// before they could overflow, leaving the 8 rows' sums in the 8 int32 lanes. Scales (and q4
// offsets) are fp16 [tiles, nb, 8] (q6: [tiles, nb, 2, 8]), one 16-byte load per block (and
// half). Each output accumulates block by block: acc = fma(s * dx, sum, acc), then for q4
// acc = fma(o, sx, acc) (sx = dx * sum(xq)); q6: h = s0 * sum0, acc = fma(dx, fma(s1, sum1, h), acc).
// On Zen 4 the float multiplies and fmas share the two pipes that run dpbusd (the shifts, ands and
// conversions do not), so each one per row and block costs about a dpbusd: q6's offset fmas and second
// multiply (removed in session 31) cost its 8-row products 15-20 %. Unpacking is shared by all activation
// rows of a pass. With scales (and offsets) a weight costs 5 bits (q4), 5.5 (q5) or 7 (q6), and rows need no
// padding along K.
//
// q8 tiles hold whole bytes u = q + 128 (dpbusd takes its weights unsigned), read without unpacking; each
// row's block sum starts from -128 * sum(xq) (an exact integer per activation row and block), so it ends
// as sum(q * xq) exactly. Without VNNI the codes go back to signed and their signs move onto the
// activations (maddubs of |q| and sign(x, q), widened per vector). No offset: acc = fma(s * dx, sum, acc)
// per block, 8.5 bits per weight. (Row by row, as q8 ran before session 30, it reached a third of the
// tiles' multiply-add rate in 8- to 16-row products: every block's lanes had to be summed.)
//
// Row independence: every output element y[m, n] is computed by the same sequence of floating-point
// operations whatever M is and whichever rows share a chunk (the chunk only decides how many rows
// reuse one unpacked weight row or tile). This is what lets a K+1-token verification reproduce one-token
// decoding bit for bit. Build with -ffp-contract=off so the compiler cannot fuse differently in
// different instantiations.
//
// The AVX-512 build runs two tiles at once in 512-bit vectors (tile2_dot) for products of 3 or more
// rows (fewer: tile_dot, see tile_gemm_part), up to 8 activation rows per
// pass: each lane does what tile_dot does for its row, so the bits are the same as the other builds'.
// The amx build (AVX-512 plus AMX tiles, Sapphire Rapids and later) hands q4 and q5 products of 12 or more rows
// to the tile unit (amx_pair): the same integer sums, then the same float steps per output.
//
// Threads: the N outputs are split into contiguous ranges of whole tiles, one per OpenMP thread
// (the caller passes torch.get_num_threads(); torch's own libgomp serves the pragma, so there is one
// thread pool). Each kernel's `_part` does thread t's range; the entry points run it in a parallel region of
// their own, ssd_decoder_layers runs all of a forward's stages in one region (ssd_team::linear).

#include <cmath>
#include <limits>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common.h"

namespace {

constexpr int QK = 32;
constexpr int FMT_Q4 = 1, FMT_Q8 = 2, FMT_Q5 = 3, FMT_Q6 = 4, FMT_Q4G = 5;
// The code layout of format FMT (q4g64 packs its codes as q4), whether it has q4's offsets, and log2 of the
// blocks of 32 that share one scale (and offset).
template <int FMT>
constexpr int CODES = FMT == FMT_Q4G ? FMT_Q4 : FMT;
template <int FMT>
constexpr bool HAS_OFFSET = CODES<FMT> == FMT_Q4;
template <int FMT>
constexpr int SCALE_SHIFT = FMT == FMT_Q4G ? 1 : 0;

// sum + (4 adjacent u8 x s8 products) per int32 lane in one VNNI instruction, where the CPU has it
// (ssd.kernels.cpu picks the build); without it the int8 dot products are maddubs (int16 lanes, which
// these codes cannot saturate) + madd. Integer sums are exact, so both builds give the same bits.
#if defined(__AVXVNNI__)
#define SSD_VNNI 1
inline __m256i dpbusd(__m256i sum, __m256i u8, __m256i s8) { return _mm256_dpbusd_avx_epi32(sum, u8, s8); }
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SSD_VNNI 1
inline __m256i dpbusd(__m256i sum, __m256i u8, __m256i s8) { return _mm256_dpbusd_epi32(sum, u8, s8); }
#else
#define SSD_VNNI 0
#endif

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
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

// Quantised activations as the kernels read them: xq [M, nbp * 32], dx and sx = dx * sum(xq) [M, nbp], nbp =
// blocks rounded up to a whole group of 8, zero padded. For the formats whose codes carry an offset c (q5: 16,
// q6: 32, q8 with VNNI: 128, see the top of this file) also start [M, nbp, parts] = -c * sum(xq) of each part
// (q6: half block), where that part's integer sums start: stored ready to broadcast from memory (computed in
// the kernel, the multiply and a register broadcast cost what the offset fma they replace did). (Block-major
// order, a block's rows side by side, measured slower in 8-row forwards.)
struct QActs {
    int8_t* xq;
    float* dx;
    float* sx;
    int32_t* start;  // or nullptr (c = 0)
    int nbp;
    int c;
    int parts;
};

inline size_t act_at(const QActs& a, int m, int b) { return static_cast<size_t>(m) * a.nbp + b; }

// Zeroed activations (the padding blocks stay zero) of M rows of K, for codes offset by c in `parts` parts per
// block.
QActs alloc_acts(int M, int K, int c, int parts) {
    const int nbp = (K / QK + 7) / 8 * 8;
    const size_t n = static_cast<size_t>(M) * nbp;
    return QActs{static_cast<int8_t*>(calloc(n * QK, 1)), static_cast<float*>(calloc(n, sizeof(float))),
                 static_cast<float*>(calloc(n, sizeof(float))),
                 c != 0 ? static_cast<int32_t*>(calloc(n * parts, sizeof(int32_t))) : nullptr, nbp, c, parts};
}

void free_acts(QActs& a) {
    free(a.xq);
    free(a.dx);
    free(a.sx);
    free(a.start);
}

// Rows n0..n0+7 (one tile: codes w [nb, block_bytes], fp16 scales sc [nb, parts, 8] and q4 offsets
// oc [nb, 8]) against R activation rows from `a` (starting at row m0): out[i * 8 + r] =
// y[m0 + i, n0 + r]. `pf`: prefetch this many bytes ahead in the weight stream (0: none); tiles are
// contiguous, so a pass reading ahead also warms the next tile.
// Bytes per tile and block (nibbles + high-bit planes), and scales per block (q6: one per 16 weights).
template <int FMT>
constexpr int TILE_BLOCK_BYTES = CODES<FMT> == FMT_Q4 ? 128 : FMT == FMT_Q5 ? 160 : FMT == FMT_Q6 ? 192 : 256;
template <int FMT>
constexpr int SCALE_PARTS = FMT == FMT_Q6 ? 2 : 1;

// Prefetch block b's codes `pf` bytes ahead in a tile's code stream w into L2 (tiles are contiguous, so this
// also warms the next tile) and PF_L1 bytes ahead into L1, and its scales (16 bytes per block and part: a line
// per part every 4 blocks) and q4 offsets into L1. Two distances because L1 (32-48 KiB) cannot hold 16 KiB of
// prefetched codes next to the activations and the other streams: with one T0 prefetch 16 KiB ahead, lines
// were evicted before use, and on the Zen 4 machine (session 27) the 1.5B's decode step took 1.17-1.37x as long
// (0.5B: 1.2x; 4-token verification 1.1-1.3x; 8 tokens unchanged). always_inline: as a function of its own,
// GCC's pure-const pass finds it has no side effects (prefetches count as none), marks it const and deletes every call, so the tile kernels ran without
// software prefetch (8-row products of cold weights 1.6-2x slower; tests/test_kernel_codegen.py).
constexpr int PF_L1 = 2048;
template <int FMT>
__attribute__((always_inline)) inline void prefetch_block(const uint8_t* w, const uint16_t* sc, const uint16_t* oc, int b, int pf) {
    constexpr int block_bytes = TILE_BLOCK_BYTES<FMT>, parts = SCALE_PARTS<FMT>;
    const char* wb = reinterpret_cast<const char*>(w + static_cast<size_t>(b) * block_bytes);
    for (int q = 0; q < block_bytes; q += 64) _mm_prefetch(wb + pf + q, _MM_HINT_T1);
    for (int q = 0; q < block_bytes; q += 64) _mm_prefetch(wb + PF_L1 + q, _MM_HINT_T0);
    constexpr int shift = SCALE_SHIFT<FMT>;
    if (b % (4 << shift) == 0) {  // a line holds 4 scale rows
        const int g = b >> shift;
        for (int q = 0; q < parts; ++q)
            _mm_prefetch(reinterpret_cast<const char*>(sc + g * parts * 8) + (pf >> shift) / 8 + 64 * q, _MM_HINT_T0);
        if (HAS_OFFSET<FMT>) _mm_prefetch(reinterpret_cast<const char*>(oc + g * 8) + (pf >> shift) / 8, _MM_HINT_T0);
    }
}

// The one-tile (256-bit) and two-tile (512-bit) kernels unpack codes alike; these overloads let one
// template (unpack_codes) serve both vector widths.
inline __m256i v_and(__m256i a, __m256i b) { return _mm256_and_si256(a, b); }
inline __m256i v_or(__m256i a, __m256i b) { return _mm256_or_si256(a, b); }
inline __m256i v_shift16(__m256i a, int left) {
    return left >= 0 ? _mm256_slli_epi16(a, left) : _mm256_srli_epi16(a, -left);
}
template <class V>
V v_bytes(char c);
template <>
inline __m256i v_bytes<__m256i>(char c) { return _mm256_set1_epi8(c); }
#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512i v_and(__m512i a, __m512i b) { return _mm512_and_si512(a, b); }
inline __m512i v_or(__m512i a, __m512i b) { return _mm512_or_si512(a, b); }
inline __m512i v_shift16(__m512i a, int left) {
    return left >= 0 ? _mm512_slli_epi16(a, left) : _mm512_srli_epi16(a, -left);
}
template <>
inline __m512i v_bytes<__m512i>(char c) { return _mm512_set1_epi8(c); }
#endif

// One block's codes for scale part `part`: lo[cc] / hi[cc] = the low / high nibbles of chunk
// part * chunks + cc, with the high-bit planes (q5: bit 4; q6: bits 4-5 of vector v) moved into place
// by 16-bit shifts (no bit crosses into the masked bits of the other byte); q8's vectors 2c and 2c + 1
// as stored. `load(off)`: the 32 bytes at offset `off` of the block, of one tile or of two (V).
template <int FMT, class V, class Load>
inline void unpack_codes(Load load, int part, V* lo, V* hi) {
    constexpr int chunks = 4 / SCALE_PARTS<FMT>;
    if constexpr (FMT == FMT_Q8) {
#pragma GCC unroll 4
        for (int c = 0; c < chunks; ++c) {
            lo[c] = load(64 * c);
            hi[c] = load(64 * c + 32);
        }
        return;
    }
    const V mask = v_bytes<V>(0x0F), high_mask = v_bytes<V>(FMT == FMT_Q6 ? 0x30 : 0x10);
    V plane[2] = {v_bytes<V>(0), v_bytes<V>(0)};
    if (FMT != FMT_Q4) plane[0] = load(128);
    if (FMT == FMT_Q6) plane[1] = load(160);
    auto high = [&](int v) {
        const int from = FMT == FMT_Q5 ? v : 2 * (v % 4);  // the bit (q6: the 2 bits) of vector v
        return v_and(v_shift16(plane[FMT == FMT_Q6 ? v / 4 : 0], 4 - from), high_mask);
    };
#pragma GCC unroll 4
    for (int cc = 0; cc < chunks; ++cc) {
        const int c = part * chunks + cc;
        const V v = load(32 * c);
        lo[cc] = v_and(v, mask);
        hi[cc] = v_and(v_shift16(v, -4), mask);
        if (FMT != FMT_Q4) {
            lo[cc] = v_or(lo[cc], high(2 * c));
            hi[cc] = v_or(hi[cc], high(2 * c + 1));
        }
    }
}

// The code offset c of format FMT in the kernels that start their integer sums at -c * sum(xq): the sums
// then end as sum((q - c) * xq) exactly and the float steps need no offset term. q4's offsets are per row
// and block (an fma with sx); q8 without VNNI turns its codes back to signed.
template <int FMT>
constexpr int CODE_OFFSET = FMT == FMT_Q5 ? 16 : FMT == FMT_Q6 ? 32 : FMT == FMT_Q8 && SSD_VNNI ? 128 : 0;

// Where the integer sum of activation row `at` (row-major index of row and block) and scale part `part` starts.
template <int FMT>
inline __m256i sum_start8(const QActs& a, size_t at, int part) {
    if constexpr (CODE_OFFSET<FMT> == 0) return _mm256_setzero_si256();
    return _mm256_set1_epi32(a.start[at * SCALE_PARTS<FMT> + part]);
}

// noinline (also tile2_dot): inlined, the kernel's registers were allocated anew in each caller, and one
// arrangement of the callers ran q6's 8-row loop 1.6x slower.
template <int FMT, int R>
__attribute__((noinline)) void tile_dot(const uint8_t* w, const uint16_t* sc, const uint16_t* oc, const QActs& a,
                                        int m0, int nb, float* out, int pf) {
    constexpr int block_bytes = TILE_BLOCK_BYTES<FMT>, parts = SCALE_PARTS<FMT>;
    constexpr int chunks = 4 / parts;  // chunks of 8 weights per scale
    __m256 acc[R], half[R];  // half (q6): s * sum of the block's first half block, then plus the second's
    for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
    [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
    for (int b = 0; b < nb; ++b) {
        const uint8_t* wb = w + static_cast<size_t>(b) * block_bytes;
        if (pf != 0) prefetch_block<FMT>(w, sc, oc, b, pf);
        auto load = [&](int off) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + off)); };
#pragma GCC unroll 2  // a compile-time part keeps q6's high-bit planes in registers
        for (int part = 0; part < parts; ++part) {
            // int16 lanes 2r, 2r + 1 (int32 lane r) hold weight row r's partial sums; widened to int32
            // before they could overflow (q4: after 8 maddubs, 8 * 2 * 15 * 127 < 2^15; q5: after 4,
            // 4 * 2 * 31 * 127; q6: after 2, 2 * 2 * 63 * 127). The part's codes are unpacked first and
            // then run against one activation row after another: interleaving rows and chunks instead
            // made GCC spill the products (~10-15 % slower at 4-8 rows).
            const size_t at0 = act_at(a, m0, b), rs = a.nbp;  // the pass's rows of block b, nbp blocks apart
            const int8_t* xb = a.xq + at0 * QK;
            __m256i sum16[R], sum32[R];
            for (int i = 0; i < R; ++i) {
                sum16[i] = _mm256_setzero_si256();
                sum32[i] = sum_start8<FMT>(a, at0 + rs * i, part);
            }
            __m256i lo[chunks], hi[chunks];
            unpack_codes<CODES<FMT>>(load, part, lo, hi);
            if (FMT == FMT_Q8 && !SSD_VNNI)  // maddubs cannot take u = q + 128: back to signed codes
                for (int cc = 0; cc < chunks; ++cc) {
                    lo[cc] = _mm256_xor_si256(lo[cc], _mm256_set1_epi8(static_cast<char>(0x80)));
                    hi[cc] = _mm256_xor_si256(hi[cc], _mm256_set1_epi8(static_cast<char>(0x80)));
                }
#pragma GCC unroll 4
            for (int i = 0; i < R; ++i) {
#pragma GCC unroll 4
                for (int cc = 0; cc < chunks; ++cc) {
                    const int c = part * chunks + cc;
                    const bool widen = CODES<FMT> == FMT_Q4 ? c == 3 : FMT == FMT_Q5 ? c % 2 == 1 : true;
                    int32_t x_lo, x_hi;  // activations 8c..8c+3 and 8c+4..8c+7, broadcast to every lane
                    memcpy(&x_lo, xb + QK * rs * i + 8 * c, 4);
                    memcpy(&x_hi, xb + QK * rs * i + 8 * c + 4, 4);
#if SSD_VNNI
                    // No int16 stage: low and high nibbles go to two int32 chains (half the dependent
                    // latency), added up below.
                    (void)widen;
                    sum32[i] = dpbusd(sum32[i], lo[cc], _mm256_set1_epi32(x_lo));
                    sum16[i] = dpbusd(sum16[i], hi[cc], _mm256_set1_epi32(x_hi));
#else
                    if constexpr (FMT == FMT_Q8) {  // |q| x sign(x, q): two products fit an int16 lane, four do not
                        (void)widen;
                        const __m256i pl = _mm256_maddubs_epi16(_mm256_abs_epi8(lo[cc]), _mm256_sign_epi8(_mm256_set1_epi32(x_lo), lo[cc]));
                        const __m256i ph = _mm256_maddubs_epi16(_mm256_abs_epi8(hi[cc]), _mm256_sign_epi8(_mm256_set1_epi32(x_hi), hi[cc]));
                        sum32[i] = _mm256_add_epi32(sum32[i], _mm256_add_epi32(_mm256_madd_epi16(pl, ones), _mm256_madd_epi16(ph, ones)));
                        continue;
                    }
                    sum16[i] = _mm256_add_epi16(sum16[i], _mm256_add_epi16(_mm256_maddubs_epi16(lo[cc], _mm256_set1_epi32(x_lo)),
                                                                           _mm256_maddubs_epi16(hi[cc], _mm256_set1_epi32(x_hi))));
                    if (widen) {
                        sum32[i] = _mm256_add_epi32(sum32[i], _mm256_madd_epi16(sum16[i], ones));
                        sum16[i] = _mm256_setzero_si256();
                    }
#endif
                }
            }
#if SSD_VNNI
            for (int i = 0; i < R; ++i) sum32[i] = _mm256_add_epi32(sum32[i], sum16[i]);
#endif
            const int g = b >> SCALE_SHIFT<FMT>;
            const __m256 s8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + (g * parts + part) * 8)));
            __m256 o8 = _mm256_setzero_ps();
            if constexpr (HAS_OFFSET<FMT>) o8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(oc + g * 8)));
#pragma GCC unroll 4
            for (int i = 0; i < R; ++i) {
                const size_t at = at0 + rs * i;
                const __m256 sum = _mm256_cvtepi32_ps(sum32[i]);
                if constexpr (parts == 1)
                    acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(s8, _mm256_set1_ps(a.dx[at])), sum, acc[i]);
                else if (part == 0)
                    half[i] = _mm256_mul_ps(s8, sum);
                else
                    acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(a.dx[at]), _mm256_fmadd_ps(s8, sum, half[i]), acc[i]);
                if constexpr (HAS_OFFSET<FMT>) acc[i] = _mm256_fmadd_ps(o8, _mm256_set1_ps(a.sx[at]), acc[i]);
            }
        }
    }
    for (int i = 0; i < R; ++i) _mm256_storeu_ps(out + 8 * i, acc[i]);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SSD_TILE2 1
// Two tiles per pass in 512-bit vectors (the avx512vnni build): chunk c of tile A in the low 256 bits
// and of tile B in the high ones, so one broadcast activation and one dpbusd serve 16 weight rows.
// Every lane does exactly what tile_dot does for its row (the same integer sums, then the same two
// fma per block), so the outputs are bit-identical to tile_dot's; the instructions per weight halve.
// Up to 4 rows, low and high nibbles go to two dpbusd chains per row (tile_dot's latency argument);
// at 5-8 rows one chain each, as the rows' chains are independent. Each row's sums are scaled into
// its accumulator before the next row starts, so 8 accumulators, the unpacked codes and one row's
// sums fit the 32 vector registers: the weights are unpacked once for 8 rows and nothing spills
// (summing all rows first spilled, 7-16 % slower at 8 rows).
inline __m512i load2(const uint8_t* a, const uint8_t* b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

inline __m512 load_half2(const uint16_t* a, const uint16_t* b) {  // 8 fp16 from each tile as 16 fp32
    return _mm512_cvtph_ps(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
}

// sum += dpbusd(w, the 4 activation bytes at x in every lane). The broadcast rides in the instruction
// ({1to16}): GCC emits a separate vpbroadcastd, one more uop per dpbusd, which at 5-8 rows is what
// limits the tile kernels (they issue 16 such pairs per block and row).
inline __m512i dpbusd_bcast(__m512i sum, __m512i w, const int8_t* x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(sum) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
    return sum;
}

// Tiles at wa and wb (scales sa, sb; q4 offsets oa, ob) against R activation rows: out[16 i + r] =
// tile A's row r, out[16 i + 8 + r] = tile B's.
template <int FMT, int R>
__attribute__((noinline)) void tile2_dot(const uint8_t* wa, const uint8_t* wb, const uint16_t* sa,
                                         const uint16_t* sb, const uint16_t* oa, const uint16_t* ob, const QActs& a,
                                         int m0, int nb, float* out, int pf) {
    constexpr int block_bytes = TILE_BLOCK_BYTES<FMT>, parts = SCALE_PARTS<FMT>;
    constexpr int chunks = 4 / parts;
    __m512 acc[R], half[R];  // as tile_dot's
    for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        const uint8_t* ba = wa + static_cast<size_t>(b) * block_bytes;
        const uint8_t* bb = wb + static_cast<size_t>(b) * block_bytes;
        if (pf != 0) {
            prefetch_block<FMT>(wa, sa, oa, b, pf);
            prefetch_block<FMT>(wb, sb, ob, b, pf);
        }
        auto load = [&](int off) { return load2(ba + off, bb + off); };
#pragma GCC unroll 2  // a compile-time part keeps q6's high-bit planes in registers
        for (int part = 0; part < parts; ++part) {
            __m512i lo[chunks], hi[chunks];
            unpack_codes<CODES<FMT>>(load, part, lo, hi);
            const int g = b >> SCALE_SHIFT<FMT>;
            const __m512 s16 = load_half2(sa + (g * parts + part) * 8, sb + (g * parts + part) * 8);
            __m512 o16 = _mm512_setzero_ps();
            if constexpr (HAS_OFFSET<FMT>) o16 = load_half2(oa + g * 8, ob + g * 8);
            // The pass's rows of block b, nbp blocks apart: computed from one pointer each (not per row,
            // which took ~40 % of the instructions of q6's 8-row loop, half of them stack spills).
            const size_t at0 = act_at(a, m0, b), rs = a.nbp;
            const int8_t* xb = a.xq + at0 * QK + 8 * part * chunks;
            const float* dxb = a.dx + at0;
            const float* sxb = a.sx + at0;
#pragma GCC unroll 8
            for (int i = 0; i < R; ++i) {
                __m512i sum_lo = CODE_OFFSET<FMT> == 0 ? _mm512_setzero_si512()
                                                       : _mm512_set1_epi32(a.start[(at0 + rs * i) * parts + part]);
                __m512i sum_hi = _mm512_setzero_si512();
                const int8_t* x = xb + QK * rs * i;
#pragma GCC unroll 4
                for (int cc = 0; cc < chunks; ++cc) {
                    sum_lo = dpbusd_bcast(sum_lo, lo[cc], x + 8 * cc);
                    if (R <= 4)  // two chains halve the dependent latency
                        sum_hi = dpbusd_bcast(sum_hi, hi[cc], x + 8 * cc + 4);
                    else  // 5-8 rows are enough independent chains; one saves the add
                        sum_lo = dpbusd_bcast(sum_lo, hi[cc], x + 8 * cc + 4);
                }
                const __m512i sum = R <= 4 ? _mm512_add_epi32(sum_lo, sum_hi) : sum_lo;
                const __m512 sumf = _mm512_cvtepi32_ps(sum);
                if constexpr (parts == 1)
                    acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(s16, _mm512_set1_ps(dxb[rs * i])), sumf, acc[i]);
                else if (part == 0)
                    half[i] = _mm512_mul_ps(s16, sumf);
                else
                    acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(dxb[rs * i]), _mm512_fmadd_ps(s16, sumf, half[i]), acc[i]);
                if constexpr (HAS_OFFSET<FMT>) acc[i] = _mm512_fmadd_ps(o16, _mm512_set1_ps(sxb[rs * i]), acc[i]);
            }
        }
    }
    for (int i = 0; i < R; ++i) _mm512_storeu_ps(out + 16 * i, acc[i]);
}
#else
#define SSD_TILE2 0
#endif

// A pass's outputs: part[width * i + r] (activation row i of R, weight row r of `rows`) to y at `at` + i * ldy + r.
inline void store_pass(const float* part, int width, int R, int rows, void* y, int y_bf16, size_t at, int ldy) {
    for (int i = 0; i < R; ++i)
        for (int r = 0; r < rows; ++r) {
            const size_t o = at + static_cast<size_t>(i) * ldy + r;
            if (y_bf16)
                static_cast<uint16_t*>(y)[o] = f32_to_bf16(part[width * i + r]);
            else
                static_cast<float*>(y)[o] = part[width * i + r];
        }
}

// q4, q5, q6: tiles of 8 rows split between threads; thread t of nt computes its contiguous share of the
// tiles. One tile at a time, up to 4 activation rows per pass (tile_dot), or in the AVX-512 build pairs
// of tiles, up to 8 rows per pass (tile2_dot; an odd last tile goes alone) where a pass has 3 or more rows:
// with 1 or 2 the pairs ran slower than single tiles (1.5B decode, 1 thread: 45.4 ms against 59.9 in session
// 19; 0.77x / 0.96x for 1 / 2 rows on the Zen 4 machine, session 27; a pair reads 6 streams where a single
// tile reads 3, and for K = 1536 each is only 6 KiB long), with 3 or 4 faster once the codes were prefetched
// into L2 as well (Zen 4: 1.5B 3- / 4-token forwards 1.18x / 1.21-1.28x, 0.5B 1.01x / 1.10x).
template <int FMT>
void single_tiles(const uint8_t* w, const uint16_t* scale, const uint16_t* offset, const QActs& a, int M, int N,
                  int K, void* y, int y_bf16, int ldy, int tile, int t1) {
    constexpr int RC = 4, block_bytes = TILE_BLOCK_BYTES<FMT>, parts = SCALE_PARTS<FMT>;
    const int nb = K / QK;
    alignas(64) float part[RC * 8];
    for (; tile < t1; ++tile) {
        const uint8_t* wt = w + static_cast<size_t>(tile) * nb * block_bytes;
        const int ng = nb >> SCALE_SHIFT<FMT>;  // scale rows per tile
        const uint16_t* st = scale + static_cast<size_t>(tile) * ng * parts * 8;
        const uint16_t* ot = HAS_OFFSET<FMT> ? offset + static_cast<size_t>(tile) * ng * 8 : nullptr;
        const int rows = N - 8 * tile < 8 ? N - 8 * tile : 8;
        for (int m0 = 0; m0 < M; m0 += RC) {
            // The first pass streams the weights from memory. 16 KiB ahead into L2 (then 2 KiB into L1,
            // prefetch_block): at 8 rows 0.89-0.91x the time of 8 KiB on the 1.5B (decode and the 0.5B within
            // +-4 %; measured before the L1 prefetch); 32 KiB slowed decode steps.
            const int pf = m0 == 0 ? 16384 : 0;
            switch (M - m0 < RC ? M - m0 : RC) {
                case 1: tile_dot<FMT, 1>(wt, st, ot, a, m0, nb, part, pf); break;
                case 2: tile_dot<FMT, 2>(wt, st, ot, a, m0, nb, part, pf); break;
                case 3: tile_dot<FMT, 3>(wt, st, ot, a, m0, nb, part, pf); break;
                default: tile_dot<FMT, 4>(wt, st, ot, a, m0, nb, part, pf); break;
            }
            store_pass(part, 8, M - m0 < RC ? M - m0 : RC, rows, y, y_bf16, static_cast<size_t>(m0) * ldy + 8 * tile, ldy);
        }
    }
}

#if SSD_TILE2
// Codes, scales and q4 offsets of tiles `tile` and `tile` + 1 (a pair for tile2_dot or amx_pair).
template <int FMT>
struct TilePair {
    const uint8_t *wa, *wb;
    const uint16_t *sa, *sb, *oa, *ob;
    TilePair(const uint8_t* w, const uint16_t* scale, const uint16_t* offset, int tile, int nb) {
        constexpr int block_bytes = TILE_BLOCK_BYTES<FMT>, parts = SCALE_PARTS<FMT>;
        const int ng = nb >> SCALE_SHIFT<FMT>;  // scale rows per tile
        wa = w + static_cast<size_t>(tile) * nb * block_bytes;
        sa = scale + static_cast<size_t>(tile) * ng * parts * 8;
        oa = HAS_OFFSET<FMT> ? offset + static_cast<size_t>(tile) * ng * 8 : nullptr;
        wb = wa + static_cast<size_t>(nb) * block_bytes;
        sb = sa + static_cast<size_t>(ng) * parts * 8;
        ob = HAS_OFFSET<FMT> ? oa + static_cast<size_t>(ng) * 8 : nullptr;
    }
};

template <int FMT>
void tile_pairs(const uint8_t* w, const uint16_t* scale, const uint16_t* offset, const QActs& a, int M, int N, int K,
                void* y, int y_bf16, int ldy, int t0, int t1) {
    constexpr int RC2 = 8;
    const int nb = K / QK;
    alignas(64) float part[RC2 * 16];
    int tile = t0;
    for (; tile + 1 < t1; tile += 2) {
        const TilePair<FMT> p(w, scale, offset, tile, nb);
        const int rows = N - 8 * tile < 16 ? N - 8 * tile : 16;
        for (int m0 = 0; m0 < M; m0 += RC2) {
            const int pf = m0 == 0 ? 16384 : 0;  // per stream (both tiles stream from memory); as single_tiles
            switch (M - m0 < RC2 ? M - m0 : RC2) {
                case 1: tile2_dot<FMT, 1>(p.wa, p.wb, p.sa, p.sb, p.oa, p.ob, a, m0, nb, part, pf); break;
                case 2: tile2_dot<FMT, 2>(p.wa, p.wb, p.sa, p.sb, p.oa, p.ob, a, m0, nb, part, pf); break;
                case 3: tile2_dot<FMT, 3>(p.wa, p.wb, p.sa, p.sb, p.oa, p.ob, a, m0, nb, part, pf); break;
                case 4: tile2_dot<FMT, 4>(p.wa, p.wb, p.sa, p.sb, p.oa, p.ob, a, m0, nb, part, pf); break;
                case 5: tile2_dot<FMT, 5>(p.wa, p.wb, p.sa, p.sb, p.oa, p.ob, a, m0, nb, part, pf); break;
                case 6: tile2_dot<FMT, 6>(p.wa, p.wb, p.sa, p.sb, p.oa, p.ob, a, m0, nb, part, pf); break;
                case 7: tile2_dot<FMT, 7>(p.wa, p.wb, p.sa, p.sb, p.oa, p.ob, a, m0, nb, part, pf); break;
                default: tile2_dot<FMT, 8>(p.wa, p.wb, p.sa, p.sb, p.oa, p.ob, a, m0, nb, part, pf); break;
            }
            store_pass(part, 16, M - m0 < RC2 ? M - m0 : RC2, rows, y, y_bf16, static_cast<size_t>(m0) * ldy + 8 * tile, ldy);
        }
    }
    if (tile < t1) single_tiles<FMT>(w, scale, offset, a, M, N, K, y, y_bf16, ldy, tile, t1);
}
#endif

#if SSD_TILE2 && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define SSD_AMX 1
// AMX (the amx build): a pair of tiles' integer block sums for up to 16 activation rows in one tile multiply.
// The unpacked codes of a block (or q6 half block) are already AMX's B layout: tile2_dot's vector lo[c] holds
// codes 8c..8c+3 of the pair's 16 weight rows, 4 bytes per row, i.e. B's row 2c (hi[c]: row 2c + 1); A is the
// activation rows' int8 block straight from QActs (rows nbp * 32 bytes apart). TDPBSUD (signed activations x
// unsigned codes) gives the exact sums sum(q * xq), the sum starts (QActs::start) are added as integers, and
// each output then takes tile2_dot's float steps in the same order: the same bits as every other build.
// Tiles: 0, 1 = C [R x 16 int32]; 2, 3 = A [R x 32 / parts bytes]; 4, 5 = B [8 / parts x 64 bytes].
struct AmxConfig {
    uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Linux hands out the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), once
// per process; without it a tile instruction faults, so a refusal keeps the AVX-512 kernels.
bool amx_permitted() {
    static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return ok;
}

constexpr int AMX_ROWS = 16;  // activation rows per tile multiply (AMX's maximum)
int g_amx_min_rows = 12;  // products of fewer rows keep tile2_dot (ssd_amx_min_rows; 0: never AMX)

// Tiles at wa, wb (as tile2_dot) against activation rows m0..m0+R-1, R <= 16: acc[16 i + r] as tile2_dot's out.
// In groups of AMX_GROUP blocks, three phases each: unpack the group's codes, run its tile multiplies, scale its
// sums into the accumulators. A block at a time, every multiply waited for the stores just before it and every
// scaling for the multiply (~115 cycles per block: 2.4x tile2_dot's time at 4 rows); the group's multiplies are
// independent, on two alternating sets of tiles, and read and write only buffers written a phase earlier.
constexpr int AMX_GROUP = 8;
template <int FMT>
__attribute__((noinline)) void amx_pair(const uint8_t* wa, const uint8_t* wb, const uint16_t* sa, const uint16_t* sb,
                                        const uint16_t* oa, const uint16_t* ob, const QActs& a, int m0, int R, int nb,
                                        float* acc_out, int pf) {
    constexpr int block_bytes = TILE_BLOCK_BYTES<FMT>, parts = SCALE_PARTS<FMT>;
    constexpr int chunks = 4 / parts, steps = AMX_GROUP * parts;
    // B per block and part: rows 2c, 2c + 1 = chunk c's low, high codes; the sums [R x 16] of each.
    alignas(64) uint8_t codes[steps][2 * chunks * 64];
    alignas(64) int32_t sums[steps][AMX_ROWS * 16];
    __m512 acc[AMX_ROWS], half[AMX_ROWS];  // as tile2_dot's; rows i >= R stay unused
#pragma GCC unroll 16
    for (int i = 0; i < AMX_ROWS; ++i) acc[i] = _mm512_setzero_ps();
    const size_t rs = a.nbp;
    for (int g0 = 0; g0 < nb; g0 += AMX_GROUP) {
        const int gn = nb - g0 < AMX_GROUP ? nb - g0 : AMX_GROUP;
        for (int j = 0; j < gn; ++j) {
            const int b = g0 + j;
            const uint8_t* ba = wa + static_cast<size_t>(b) * block_bytes;
            const uint8_t* bb = wb + static_cast<size_t>(b) * block_bytes;
            if (pf != 0) {
                prefetch_block<FMT>(wa, sa, oa, b, pf);
                prefetch_block<FMT>(wb, sb, ob, b, pf);
            }
            auto load = [&](int off) { return load2(ba + off, bb + off); };
#pragma GCC unroll 2
            for (int part = 0; part < parts; ++part) {
                __m512i lo[chunks], hi[chunks];
                unpack_codes<CODES<FMT>>(load, part, lo, hi);
                for (int cc = 0; cc < chunks; ++cc) {
                    _mm512_store_si512(codes[j * parts + part] + 128 * cc, lo[cc]);
                    _mm512_store_si512(codes[j * parts + part] + 128 * cc + 64, hi[cc]);
                }
            }
        }
        const int8_t* x0 = a.xq + act_at(a, m0, g0) * QK;
        const int n_steps = gn * parts;
        auto step = [&](int k) { return x0 + (k / parts) * QK + (k % parts) * (QK / parts); };
        int k = 0;
        for (; k + 1 < n_steps; k += 2) {  // tiles 0, 2, 4 and 1, 3, 5: C, A, B
            _tile_loadd(4, codes[k], 64);
            _tile_loadd(2, step(k), rs * QK);
            _tile_zero(0);
            _tile_loadd(5, codes[k + 1], 64);
            _tile_loadd(3, step(k + 1), rs * QK);
            _tile_zero(1);
            _tile_dpbsud(0, 2, 4);
            _tile_dpbsud(1, 3, 5);
            _tile_stored(0, sums[k], 64);
            _tile_stored(1, sums[k + 1], 64);
        }
        if (k < n_steps) {
            _tile_loadd(4, codes[k], 64);
            _tile_loadd(2, step(k), rs * QK);
            _tile_zero(0);
            _tile_dpbsud(0, 2, 4);
            _tile_stored(0, sums[k], 64);
        }
        for (int j = 0; j < gn; ++j) {
            const int b = g0 + j;
            const size_t at0 = act_at(a, m0, b);
#pragma GCC unroll 2
            for (int part = 0; part < parts; ++part) {
                const int32_t* sp = sums[j * parts + part];
                const int g = b >> SCALE_SHIFT<FMT>;
                const __m512 s16 = load_half2(sa + (g * parts + part) * 8, sb + (g * parts + part) * 8);
                __m512 o16 = _mm512_setzero_ps();
                if constexpr (HAS_OFFSET<FMT>) o16 = load_half2(oa + g * 8, ob + g * 8);
                // Unrolled over the most rows, so the accumulators stay in registers (a runtime count kept
                // them in memory: 10 instructions per row and block instead of 5).
#pragma GCC unroll 16
                for (int i = 0; i < AMX_ROWS; ++i) {
                    if (i >= R) break;
                    const size_t at = at0 + rs * i;
                    __m512i sum = _mm512_load_si512(sp + 16 * i);
                    if constexpr (CODE_OFFSET<FMT> != 0)
                        sum = _mm512_add_epi32(sum, _mm512_set1_epi32(a.start[at * parts + part]));
                    const __m512 sumf = _mm512_cvtepi32_ps(sum);
                    if constexpr (parts == 1)
                        acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(s16, _mm512_set1_ps(a.dx[at])), sumf, acc[i]);
                    else if (part == 0)
                        half[i] = _mm512_mul_ps(s16, sumf);
                    else
                        acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(a.dx[at]), _mm512_fmadd_ps(s16, sumf, half[i]), acc[i]);
                    if constexpr (HAS_OFFSET<FMT>) acc[i] = _mm512_fmadd_ps(o16, _mm512_set1_ps(a.sx[at]), acc[i]);
                }
            }
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < AMX_ROWS; ++i) {
        if (i >= R) break;
        _mm512_store_ps(acc_out + 16 * i, acc[i]);
    }
}

// tile_pairs with amx_pair: 16 activation rows per pass; an odd last tile goes alone (single_tiles).
template <int FMT>
void amx_tile_pairs(const uint8_t* w, const uint16_t* scale, const uint16_t* offset, const QActs& a, int M, int N,
                    int K, void* y, int y_bf16, int ldy, int t0, int t1) {
    constexpr int parts = SCALE_PARTS<FMT>;
    const int nb = K / QK;
    alignas(64) float part[AMX_ROWS * 16];
    int configured = -1;  // the rows of the loaded tile configuration
    int tile = t0;
    for (; tile + 1 < t1; tile += 2) {
        const TilePair<FMT> p(w, scale, offset, tile, nb);
        const int rows = N - 8 * tile < 16 ? N - 8 * tile : 16;
        const int passes = (M + AMX_ROWS - 1) / AMX_ROWS, per = (M + passes - 1) / passes;  // 24 rows: 12 + 12
        for (int m0 = 0; m0 < M; m0 += per) {
            const int R = M - m0 < per ? M - m0 : per;
            if (R != configured) {  // per call too: other code on this thread (oneDNN) may load its own
                AmxConfig cfg;
                for (int t = 0; t < 2; ++t) {  // C, A, B: tiles t, 2 + t, 4 + t
                    cfg.rows[t] = static_cast<uint8_t>(R);
                    cfg.colsb[t] = 64;
                    cfg.rows[2 + t] = static_cast<uint8_t>(R);
                    cfg.colsb[2 + t] = QK / parts;
                    cfg.rows[4 + t] = 8 / parts;
                    cfg.colsb[4 + t] = 64;
                }
                _tile_loadconfig(&cfg);
                configured = R;
            }
            amx_pair<FMT>(p.wa, p.wb, p.sa, p.sb, p.oa, p.ob, a, m0, R, nb, part, m0 == 0 ? 16384 : 0);
            store_pass(part, 16, R, rows, y, y_bf16, static_cast<size_t>(m0) * ldy + 8 * tile, ldy);
        }
    }
    if (tile < t1) single_tiles<FMT>(w, scale, offset, a, M, N, K, y, y_bf16, ldy, tile, t1);
}
#else
#define SSD_AMX 0
#endif

template <int FMT>
void tile_gemm_part(const uint8_t* w, const uint16_t* scale, const uint16_t* offset, const QActs& a, int M, int N,
                    int K, void* y, int y_bf16, int ldy, int t, int nt) {
    const int tiles = (N + 7) / 8;
    const int t0 = static_cast<int>(static_cast<int64_t>(tiles) * t / nt);
    const int t1 = static_cast<int>(static_cast<int64_t>(tiles) * (t + 1) / nt);
#if SSD_AMX
    // q6 (two multiplies per block) and q8 gained nothing (0.88-1.15x at 12-64 rows, 1 thread, session 34).
    if ((CODES<FMT> == FMT_Q4 || FMT == FMT_Q5) && g_amx_min_rows > 0 && M >= g_amx_min_rows && amx_permitted()) {
        amx_tile_pairs<FMT>(w, scale, offset, a, M, N, K, y, y_bf16, ldy, t0, t1);
        return;
    }
#endif
#if SSD_TILE2
    if (M >= 3) {
        tile_pairs<FMT>(w, scale, offset, a, M, N, K, y, y_bf16, ldy, t0, t1);
        return;
    }
#endif
    single_tiles<FMT>(w, scale, offset, a, M, N, K, y, y_bf16, ldy, t0, t1);
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
void dense_gemm_part(const void* w, const float* xf, const float* bias, int M, int N, int K, void* y, int y_bf16,
                     int t, int nt) {
    {
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

namespace {

// One block of 32 activations (from element `at` of x) to int8: q = round_half_even(x * (1 / d)), d = absmax / 127
// (an all-zero block gives d = 0, q = 0), s = d * sum(q); with `start`, -c * sum(q) of the block (parts = 1) or
// of each half of 16 (parts = 2). A block holding a NaN or an infinity gives d = NaN, q = 0 (the outputs it feeds
// are NaN, as in float arithmetic, on every ISA); one so small that 1 / d overflows counts as zero.
inline void quantize_block(const void* x, int x_bf16, size_t at, int8_t* q_out, float& d_out, float& s_out,
                           int32_t* start, int c, int parts) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v[4];
    for (int j = 0; j < 4; ++j)
        v[j] = x_bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(
                            reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + at + 8 * j))), 16))
                      : _mm256_loadu_ps(static_cast<const float*>(x) + at + 8 * j);
    // max is exact, so the lane order of this reduction cannot change amax.
    __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                              _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    // max drops NaN operands: look for them apart (unordered with themselves)
    const __m256 nan = _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(v[0], v[0], _CMP_UNORD_Q),
                                                 _mm256_cmp_ps(v[1], v[1], _CMP_UNORD_Q)),
                                    _mm256_or_ps(_mm256_cmp_ps(v[2], v[2], _CMP_UNORD_Q),
                                                 _mm256_cmp_ps(v[3], v[3], _CMP_UNORD_Q)));
    const float amax = _mm_cvtss_f32(h);
    const bool bad = _mm256_movemask_ps(nan) != 0 || !std::isfinite(amax);
    float d = bad ? std::numeric_limits<float>::quiet_NaN() : amax / 127.0f;
    float inv = bad || d == 0.0f ? 0.0f : 1.0f / d;
    if (!std::isfinite(inv)) d = inv = 0.0f;  // too small for 1 / d: the block counts as zero
    const __m256 id = _mm256_set1_ps(inv);
    if (bad)
        for (int j = 0; j < 4; ++j) v[j] = _mm256_setzero_ps();  // q = 0: no INT_MIN from converting NaN
    __m256i q[4];
    for (int j = 0; j < 4; ++j)
        q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    // packs work per 128-bit half: the dwords come out as q0[0:4], q1[0:4], q2[0:4], q3[0:4],
    // q0[4:8], ...; one dword permute restores element order (values fit: |q| <= 127).
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q_out), bytes);
    // Integer sums are exact: any grouping gives the same totals.
    auto sum8 = [](__m256i v8) {
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v8), _mm256_extracti128_si256(v8, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        return _mm_cvtsi128_si32(s4);
    };
    const int lo = sum8(_mm256_add_epi32(q[0], q[1])), hi = sum8(_mm256_add_epi32(q[2], q[3]));
    d_out = d;
    s_out = d * static_cast<float>(lo + hi);
    if (start != nullptr && parts == 1) start[0] = -c * (lo + hi);
    if (start != nullptr && parts == 2) {
        start[0] = -c * lo;
        start[1] = -c * hi;
    }
}

}  // namespace

extern "C" {

// x [M, K] (fp32, or bf16 when x_bf16) -> xq int8 [M, K], dx = absmax / 127 and sx = dx * sum(xq) per
// (row, block) [M, K / 32]. xq = round_half_even(x * (1 / dx)); an all-zero block gives dx = 0, xq = 0.
void ssd_quantize_rows(const void* x, int x_bf16, int M, int K, int8_t* xq, float* dx, float* sx) {
    const int nb = K / QK;
    for (int m = 0; m < M; ++m)
        for (int b = 0; b < nb; ++b) {
            const size_t at = static_cast<size_t>(m) * nb + b;
            quantize_block(x, x_bf16, at * QK, xq + at * QK, dx[at], sx[at], nullptr, 0, 1);
        }
}

}  // extern "C"

namespace {

// Thread t of nt quantises its share of x's blocks (as ssd_quantize_rows) into `a`.
void quantize_into(const void* x, int bf16, int M, int K, QActs& a, int t, int nt) {
    const int nb = K / QK;
    const int64_t n = static_cast<int64_t>(M) * nb, i0 = n * t / nt, i1 = n * (t + 1) / nt;
    for (int64_t i = i0; i < i1; ++i) {
        const int m = static_cast<int>(i / nb), b = static_cast<int>(i % nb);
        const size_t at = act_at(a, m, b);
        int8_t* q = a.xq + at * QK;
        quantize_block(x, bf16, static_cast<size_t>(i) * QK, q, a.dx[at], a.sx[at],
                       a.start != nullptr ? a.start + a.parts * at : nullptr, a.c, a.parts);
    }
}

// Activations as the block GEMM of format fmt reads them.
QActs acts_for(int M, int K, int fmt) {
    if (fmt == FMT_Q5) return alloc_acts(M, K, CODE_OFFSET<FMT_Q5>, SCALE_PARTS<FMT_Q5>);
    if (fmt == FMT_Q6) return alloc_acts(M, K, CODE_OFFSET<FMT_Q6>, SCALE_PARTS<FMT_Q6>);
    if (fmt == FMT_Q8) return alloc_acts(M, K, CODE_OFFSET<FMT_Q8>, SCALE_PARTS<FMT_Q8>);
    return alloc_acts(M, K, 0, 1);
}

// Thread t of nt: its share of the outputs of the block GEMM of format fmt; y's rows are ldy elements apart.
void block_gemm_part(const uint8_t* w, const uint16_t* scale, const uint16_t* offset, int fmt, const QActs& a, int M,
                     int N, int K, void* y, int bf16, int ldy, int t, int nt) {
    if (fmt == FMT_Q4)
        tile_gemm_part<FMT_Q4>(w, scale, offset, a, M, N, K, y, bf16, ldy, t, nt);
    else if (fmt == FMT_Q4G)
        tile_gemm_part<FMT_Q4G>(w, scale, offset, a, M, N, K, y, bf16, ldy, t, nt);
    else if (fmt == FMT_Q5)
        tile_gemm_part<FMT_Q5>(w, scale, nullptr, a, M, N, K, y, bf16, ldy, t, nt);
    else if (fmt == FMT_Q6)
        tile_gemm_part<FMT_Q6>(w, scale, nullptr, a, M, N, K, y, bf16, ldy, t, nt);
    else
        tile_gemm_part<FMT_Q8>(w, scale, nullptr, a, M, N, K, y, bf16, ldy, t, nt);
}

// x's rows in fp32 as dense_tile reads them, and the bias in fp32 (nullptr without one).
struct DenseInput {
    float* xf;
    float* bias;
};

DenseInput dense_input(const void* x, int x_bf16, int M, int N, int K, int w_bf16, const void* bias) {
    DenseInput in{static_cast<float*>(malloc(sizeof(float) * static_cast<size_t>(M) * K + 32)), nullptr};
    for (int m = 0; m < M; ++m) {
        const size_t at = static_cast<size_t>(m) * K;
        if (w_bf16)
            prepare_x_row<true>(x, x_bf16, at, K, in.xf + at);
        else
            prepare_x_row<false>(x, x_bf16, at, K, in.xf + at);
    }
    if (bias != nullptr) {
        in.bias = static_cast<float*>(malloc(sizeof(float) * N));
        for (int n = 0; n < N; ++n) in.bias[n] = w_bf16 ? load_w1<true>(bias, n) : load_w1<false>(bias, n);
    }
    return in;
}

void dense_part(const void* w, int w_bf16, const DenseInput& in, int M, int N, int K, void* y, int y_bf16, int t,
                int nt) {
    if (w_bf16)
        dense_gemm_part<true>(w, in.xf, in.bias, M, N, K, y, y_bf16, t, nt);
    else
        dense_gemm_part<false>(w, in.xf, in.bias, M, N, K, y, y_bf16, t, nt);
}

}  // namespace

namespace {

// fp32 vectors of 8 (AVX2) or 16 (AVX-512) lanes, for code written once for both widths.
template <int LANES>
struct F32;
template <>
struct F32<8> {
    using V = __m256;
    static constexpr int lanes = 8;
    static __m256 zero() { return _mm256_setzero_ps(); }
    static __m256 set1(float x) { return _mm256_set1_ps(x); }
    static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
    static __m256 load_act(const void* p, size_t at, int bf16) { return load8v(p, static_cast<int64_t>(at), bf16); }
    static void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
    static __m256 mul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
    static __m256 fma(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
};
#if defined(__AVX512F__)
template <>
struct F32<16> {
    using V = __m512;
    static constexpr int lanes = 16;
    static __m512 zero() { return _mm512_setzero_ps(); }
    static __m512 set1(float x) { return _mm512_set1_ps(x); }
    static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
    static __m512 load_act(const void* p, size_t at, int bf16) {  // 16 activations as fp32 (bf16: exact)
        if (!bf16) return _mm512_loadu_ps(static_cast<const float*>(p) + at);
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + at));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    static void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
    static __m512 mul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
    static __m512 fma(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
};
#endif

// The 8 x 8 block r (row i = r[i]) transposed in place.
inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4)
        for (int j = 0; j < 2; ++j) {
            u[i + 2 * j] = _mm256_shuffle_ps(t[i + j], t[i + j + 2], _MM_SHUFFLE(1, 0, 1, 0));
            u[i + 2 * j + 1] = _mm256_shuffle_ps(t[i + j], t[i + j + 2], _MM_SHUFFLE(3, 2, 3, 2));
        }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

// Key rows `rows[0..L-1]` (element offsets into the bf16 / fp32 cache) as fp32 columns: kT[d * Lp + l] = key l's
// element d, Lp >= L a multiple of 8, columns L..Lp-1 zero. 8 keys x 8 elements at a time through registers.
inline void keys_transposed(const void* kc, int bf16, const size_t* rows, int L, int Lp, int hd, float* kT) {
    const int hd8 = hd - hd % 8;
    for (int l0 = 0; l0 < Lp; l0 += 8) {
        const int n = L - l0 < 8 ? (L - l0 > 0 ? L - l0 : 0) : 8;
        for (int d0 = 0; d0 < hd8; d0 += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; ++i)
                r[i] = i < n ? load8v(kc, static_cast<int64_t>(rows[l0 + i] + d0), bf16) : _mm256_setzero_ps();
            transpose8(r);
            for (int i = 0; i < 8; ++i) _mm256_storeu_ps(kT + static_cast<size_t>(d0 + i) * Lp + l0, r[i]);
        }
        for (int d = hd8; d < hd; ++d)
            for (int i = 0; i < 8; ++i) kT[static_cast<size_t>(d) * Lp + l0 + i] = i < n ? act_load(kc, rows[l0 + i] + d, bf16) : 0.0f;
    }
}

// The widest float vector of this build: 16 lanes with AVX-512, else 8. Scores and p x v are one fma chain per
// element whatever the width, so both builds give the same bits.
#if defined(__AVX512F__)
constexpr int ATT_W = 16;
#else
constexpr int ATT_W = 8;
#endif
constexpr int ATT_NC = 2;                // key chunks per pass in scores_block
constexpr int ATT_PAD = ATT_W * ATT_NC;  // kT's and the score rows' length Lp is a multiple of this

// sc[g * Lp + l] = scale * sum over d of q[g, d] * key l's element d, for G query heads (rows of qf, hd apart) and
// keys 0..Lr-1 of kT (keys_transposed), and whatever the keys' columns up to the next multiple of ATT_PAD give: NC
// chunks of ATT_W keys per pass, each sum one fma chain over d from 0, so a score's bits depend on nothing but its
// query and key.
template <int G, int NC>
inline void scores_block(const float* qf, int hd, const float* kT, int Lp, int Lr, float scale, float* sc) {
    using F = F32<ATT_W>;
    using V = typename F::V;
    const V sv = F::set1(scale);
    for (int l0 = 0; l0 < Lr; l0 += ATT_W * NC) {
        V acc[NC][G];
        for (int c = 0; c < NC; ++c)
            for (int g = 0; g < G; ++g) acc[c][g] = F::zero();
        const float* kd = kT + l0;
        for (int d = 0; d < hd; ++d, kd += Lp) {
#pragma GCC unroll 2
            for (int c = 0; c < NC; ++c) {
                const V k = F::load(kd + ATT_W * c);
#pragma GCC unroll 8
                for (int g = 0; g < G; ++g) acc[c][g] = F::fma(F::set1(qf[g * hd + d]), k, acc[c][g]);
            }
        }
        for (int c = 0; c < NC; ++c)
            for (int g = 0; g < G; ++g) F::store(sc + static_cast<size_t>(g) * Lp + l0 + ATT_W * c, F::mul(acc[c][g], sv));
    }
}

// acc[g, d] = sum over l < Lr of p[g * Lp + l] * v_l[d] for G heads, one fma chain per element in order of l
// (the same bits in every build): ATT_W columns of all G heads per pass, so each value vector serves G chains.
// v_l: the value row at element rows[l] of the cache vc (bf16 or fp32), read as it is stored (bf16 -> fp32 is
// exact), so no fp32 copy of the values is written and read back.
template <int G>
inline void pv_block(const float* p, int Lp, const void* vc, const size_t* rows, int bf16, int Lr, int hd, float* acc) {
    using F = F32<ATT_W>;
    using V = typename F::V;
    int d0 = 0;
    for (; d0 + ATT_W <= hd; d0 += ATT_W) {
        V a[G];
        for (int g = 0; g < G; ++g) a[g] = F::zero();
        for (int l = 0; l < Lr; ++l) {
            const V v = F::load_act(vc, rows[l] + d0, bf16);
#pragma GCC unroll 8
            for (int g = 0; g < G; ++g) a[g] = F::fma(F::set1(p[static_cast<size_t>(g) * Lp + l]), v, a[g]);
        }
        for (int g = 0; g < G; ++g) F::store(acc + static_cast<size_t>(g) * hd + d0, a[g]);
    }
    for (int g = 0; g < G; ++g)
        for (int d = d0; d < hd; ++d) {
            float s = 0.0f;
            for (int l = 0; l < Lr; ++l) s = fmaf(p[static_cast<size_t>(g) * Lp + l], act_load(vc, rows[l] + d, bf16), s);
            acc[static_cast<size_t>(g) * hd + d] = s;
        }
}

// scores_block and pv_block for any number of heads, in blocks of up to 8 (the AVX2 build: one key chunk per pass
// for 7 or 8 heads, whose accumulators would not leave registers for a second).
inline void scores(const float* qf, int group, int hd, const float* kT, int Lp, int Lr, float scale, float* sc) {
    for (int g0 = 0; g0 < group; g0 += 8) {
        const float* q = qf + static_cast<size_t>(g0) * hd;
        float* s = sc + static_cast<size_t>(g0) * Lp;
        constexpr int NC8 = ATT_W == 16 ? ATT_NC : 1;
        switch (group - g0 < 8 ? group - g0 : 8) {
            case 1: scores_block<1, ATT_NC>(q, hd, kT, Lp, Lr, scale, s); break;
            case 2: scores_block<2, ATT_NC>(q, hd, kT, Lp, Lr, scale, s); break;
            case 3: scores_block<3, ATT_NC>(q, hd, kT, Lp, Lr, scale, s); break;
            case 4: scores_block<4, ATT_NC>(q, hd, kT, Lp, Lr, scale, s); break;
            case 5: scores_block<5, ATT_NC>(q, hd, kT, Lp, Lr, scale, s); break;
            case 6: scores_block<6, ATT_NC>(q, hd, kT, Lp, Lr, scale, s); break;
            case 7: scores_block<7, NC8>(q, hd, kT, Lp, Lr, scale, s); break;
            default: scores_block<8, NC8>(q, hd, kT, Lp, Lr, scale, s); break;
        }
    }
}

inline void pv(const float* p, int Lp, int group, const void* vc, const size_t* rows, int bf16, int Lr, int hd,
               float* acc) {
    for (int g0 = 0; g0 < group; g0 += 8) {
        const float* pg = p + static_cast<size_t>(g0) * Lp;
        float* a = acc + static_cast<size_t>(g0) * hd;
        switch (group - g0 < 8 ? group - g0 : 8) {
            case 1: pv_block<1>(pg, Lp, vc, rows, bf16, Lr, hd, a); break;
            case 2: pv_block<2>(pg, Lp, vc, rows, bf16, Lr, hd, a); break;
            case 3: pv_block<3>(pg, Lp, vc, rows, bf16, Lr, hd, a); break;
            case 4: pv_block<4>(pg, Lp, vc, rows, bf16, Lr, hd, a); break;
            case 5: pv_block<5>(pg, Lp, vc, rows, bf16, Lr, hd, a); break;
            case 6: pv_block<6>(pg, Lp, vc, rows, bf16, Lr, hd, a); break;
            case 7: pv_block<7>(pg, Lp, vc, rows, bf16, Lr, hd, a); break;
            default: pv_block<8>(pg, Lp, vc, rows, bf16, Lr, hd, a); break;
        }
    }
}

// s[0..n-1] = softmax(s[0..n-1]) in place; s is readable and writable up to the next multiple of 8 (those lanes
// end as junk). The max is exact in any order; the sum runs in 8 lanes, the last chunk's lanes past n zeroed, then
// across them: a fixed order for a given n.
inline void softmax_row(float* s, int n) {
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    int l = 0;
    for (; l + 8 <= n; l += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + l));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m8);
    float mx = lanes[0];
    for (int j = 1; j < 8; ++j) mx = lanes[j] > mx ? lanes[j] : mx;
    for (; l < n; ++l) mx = s[l] > mx ? s[l] : mx;
    const __m256 mv = _mm256_set1_ps(mx);
    __m256 sum8 = _mm256_setzero_ps();
    for (l = 0; l < n; l += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + l), mv));
        _mm256_storeu_ps(s + l, e);
        const __m256 live = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps(static_cast<float>(n - l)),
                                          _CMP_LT_OQ);
        sum8 = _mm256_add_ps(sum8, _mm256_and_ps(e, live));
    }
    const __m256 inv = _mm256_set1_ps(1.0f / hsum(sum8));
    for (l = 0; l < n; l += 8) _mm256_storeu_ps(s + l, _mm256_mul_ps(_mm256_loadu_ps(s + l), inv));
}

}  // namespace

extern "C" {

// Products of at least `min_rows` activation rows run on AMX (0: none; negative: leave as is); returns the
// setting in force, 0 where this build or the OS has no AMX.
int ssd_amx_min_rows(int min_rows) {
#if SSD_AMX
    if (min_rows >= 0) g_amx_min_rows = min_rows;
    return amx_permitted() ? g_amx_min_rows : 0;
#else
    (void)min_rows;
    return 0;
#endif
}

// y [M, N] = x [M, K] @ W^T: quantise x's rows (as ssd_quantize_rows), then the block GEMM.
// x and y share one dtype (bf16 when bf16, else fp32). fmt (all in tiles): 1 q4 and 5 q4g64 (with offsets),
// 2 q8, 3 q5, 4 q6 (offset nullptr); see the top of this file. q4g64 needs K a multiple of 64.
void ssd_linear(const void* x, int M, int N, int K, const uint8_t* w, const uint16_t* scale,
                const uint16_t* offset, int fmt, void* y, int bf16, int nthreads) {
    QActs a = acts_for(M, K, fmt);
#pragma omp parallel num_threads(nthreads)
    {
        quantize_into(x, bf16, M, K, a, omp_get_thread_num(), omp_get_num_threads());
#pragma omp barrier
        block_gemm_part(w, scale, offset, fmt, a, M, N, K, y, bf16, N, omp_get_thread_num(), omp_get_num_threads());
    }
    free_acts(a);
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

// The index of the first maximum of one fp32 row, or -1 if the row holds a NaN (torch ranks NaN highest;
// the caller asks torch then). Four 8-lane accumulators (running max, its index) over consecutive chunks, a
// strict > keeps each lane's first maximum; merging lanes takes the larger value, on ties the lower index.
static int64_t argmax_row(const float* x, int64_t V) {
    int64_t best = 0;
    bool nan = false;
    int64_t i = 0;
    if (V >= 32) {
        __m256 mx[4], bad = _mm256_setzero_ps();
        __m256i at[4];
        const __m256i step = _mm256_set1_epi32(32), lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256i pos[4];
        for (int a = 0; a < 4; ++a) {
            mx[a] = _mm256_loadu_ps(x + 8 * a);
            at[a] = pos[a] = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * a));
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(mx[a], mx[a], _CMP_UNORD_Q));
        }
        for (i = 32; i + 32 <= V; i += 32) {
            for (int a = 0; a < 4; ++a) {
                pos[a] = _mm256_add_epi32(pos[a], step);
                const __m256 v = _mm256_loadu_ps(x + i + 8 * a);
                const __m256 gt = _mm256_cmp_ps(v, mx[a], _CMP_GT_OQ);
                bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                mx[a] = _mm256_blendv_ps(mx[a], v, gt);
                at[a] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at[a]), _mm256_castsi256_ps(pos[a]), gt));
            }
        }
        nan = _mm256_movemask_ps(bad) != 0;
        alignas(32) float mv[32];
        alignas(32) int32_t iv[32];
        for (int a = 0; a < 4; ++a) {
            _mm256_store_ps(mv + 8 * a, mx[a]);
            _mm256_store_si256(reinterpret_cast<__m256i*>(iv + 8 * a), at[a]);
        }
        float m = mv[0];
        best = iv[0];
        for (int l = 1; l < 32; ++l)
            if (mv[l] > m || (mv[l] == m && iv[l] < best)) {
                m = mv[l];
                best = iv[l];
            }
    } else {
        nan = x[0] != x[0];
    }
    for (i = V >= 32 ? i : 1; i < V; ++i) {  // the tail (or a short row)
        nan = nan || x[i] != x[i];
        if (x[i] > x[best]) best = i;
    }
    return nan ? -1 : best;
}

// out[m] = argmax of row m of x [M, V] fp32 (the first maximum); -1 for a row holding a NaN. Returns the
// number of such rows.
int ssd_argmax_rows(const float* x, int M, int64_t V, int64_t* out, int nthreads) {
    int nan_rows = 0;
#pragma omp parallel for num_threads(nthreads) reduction(+ : nan_rows) if (M > 1 && static_cast<int64_t>(M) * V >= (1 << 18))
    for (int m = 0; m < M; ++m) {
        out[m] = argmax_row(x + static_cast<int64_t>(m) * V, V);
        nan_rows += out[m] < 0;
    }
    return nan_rows;
}

// A per-thread work buffer of at least n floats, kept between calls: a fresh 100-200 KiB one per job was
// a heap allocation (often an mmap and its page faults) in every layer of every forward.
float* work_floats(size_t n) {
    thread_local float* buf = nullptr;
    thread_local size_t cap = 0;
    if (n > cap) {
        free(buf);
        cap = n + n / 2;
        buf = static_cast<float*>(malloc(sizeof(float) * cap));
    }
    return buf;
}

// Attention for new tokens one at a time, each over exactly the cache positions it may see (no mask):
// out[r, h] = softmax(q[r, h] . k[pos] / sqrt(hd)) @ v[pos] over pos in 0..len[r]-1, or over
// idx[off[r] .. off[r] + len[r]) when off[r] >= 0 (tree tokens). q: [R, H, hd] with row stride
// q_stride (elements), out: [R, H, hd] contiguous; caches: one
// layer [S, Hkv, max_len, hd]; q, caches and out share one dtype (bf16 or fp32); math in fp32.
// One token's result depends on its own query and keys only, so it is batch invariant.
// Jobs: (rows, kv head). Consecutive rows of one slot that see a prefix of it (off < 0, as a verification's
// tokens do) share a job of up to max(1, R / nt) rows, whose key rows are converted to fp32 once (exact, so each
// row's arithmetic is what it is alone; values are read as stored); a tree row is a job of its own. Thread t of nt:
// its contiguous share of the jobs. The keys go into fp32 columns (keys_transposed), so that scores_block
// computes ATT_W keys' scores per vector with one fma chain each and no horizontal sums (a dot product per key and
// head, summed across lanes, took 1.5-2x the time at 8-16 rows).
void attend_rows_part(const void* q, int64_t q_stride, const void* kc, const void* vc, void* out, int bf16, int R,
                      int H, int Hkv, int hd, int max_len, const int32_t* slot, const int32_t* len, const int64_t* off,
                      const int64_t* idx, int t, int nt) {
    const int group = H / Hkv;
    const float scale = 1.0f / sqrtf(static_cast<float>(hd));
    // The row groups (first row of each), the same in every thread.
    const int per = R / nt > 1 ? R / nt : 1;
    int* starts = static_cast<int*>(malloc(sizeof(int) * (R + 1)));
    int n_groups = 0;
    for (int r = 0; r < R;) {
        int e = r + 1;
        if (off[r] < 0)
            while (e < R && e - r < per && off[e] < 0 && slot[e] == slot[r]) ++e;
        starts[n_groups++] = r;
        r = e;
    }
    starts[n_groups] = R;
    const int jobs = n_groups * Hkv;
    const int j0 = static_cast<int>(static_cast<int64_t>(jobs) * t / nt);
    const int j1 = static_cast<int>(static_cast<int64_t>(jobs) * (t + 1) / nt);
    auto load = [&](const void* base, size_t at, float* dst) {
        if (bf16) {
            const uint16_t* p = static_cast<const uint16_t*>(base) + at;
            int d = 0;
            for (; d + 8 <= hd; d += 8) load8(base, static_cast<int64_t>(at) + d, 1, dst + d);
            for (; d < hd; ++d) dst[d] = bf16_to_f32(p[d]);
        } else {
            memcpy(dst, static_cast<const float*>(base) + at, sizeof(float) * hd);
        }
    };
    for (int job = j0; job < j1; ++job) {
        const int gi = job / Hkv, kvh = job % Hkv, r0 = starts[gi], r1 = starts[gi + 1];
        int L = 0;  // positions any row of the job sees
        for (int r = r0; r < r1; ++r) L = len[r] > L ? len[r] : L;
        const int Lp = (L + ATT_PAD - 1) / ATT_PAD * ATT_PAD;
        float* buf = work_floats(static_cast<size_t>(group) * (2 * hd + Lp) + static_cast<size_t>(Lp) * hd);
        float* qf = buf;                                    // [group, hd]
        float* sc = buf + static_cast<size_t>(group) * hd;  // [group, Lp]: a row's scores, then its weights
        float* acc = sc + static_cast<size_t>(group) * Lp;  // [group, hd]
        float* kT = acc + static_cast<size_t>(group) * hd;  // [hd, Lp]: the keys in fp32, one column each
        const size_t head_base = (static_cast<size_t>(slot[r0]) * Hkv + kvh) * max_len;
        auto pos_of = [&](int l) -> size_t { return off[r0] < 0 ? l : static_cast<size_t>(idx[off[r0] + l]); };
        size_t* rows = static_cast<size_t*>(malloc(sizeof(size_t) * (L + 1)));
        for (int l = 0; l < L; ++l) rows[l] = (head_base + pos_of(l)) * hd;
        // The job's keys and values are cold (the weights streamed since): all their lines requested at once
        // keep more misses in flight than the loads below would (0.5B decode: 14.6 -> 13.0 us per layer).
        const size_t es = bf16 ? 2 : 4, row_bytes = es * hd;
        for (int l = 0; l < L; ++l)
            for (size_t b = 0; b < row_bytes; b += 64) {
                _mm_prefetch(static_cast<const char*>(kc) + rows[l] * es + b, _MM_HINT_T1);
                _mm_prefetch(static_cast<const char*>(vc) + rows[l] * es + b, _MM_HINT_T1);
            }
        keys_transposed(kc, bf16, rows, L, Lp, hd, kT);
        for (int r = r0; r < r1; ++r) {
            const int Lr = len[r];
            for (int g = 0; g < group; ++g)
                load(q, static_cast<size_t>(r) * q_stride + static_cast<size_t>(kvh * group + g) * hd, qf + g * hd);
            scores(qf, group, hd, kT, Lp, Lr, scale, sc);
            for (int g = 0; g < group; ++g) softmax_row(sc + static_cast<size_t>(g) * Lp, Lr);
            pv(sc, Lp, group, vc, rows, bf16, Lr, hd, acc);  // acc[g] = sum over l of p[g, l] * v[l]
            for (int g = 0; g < group; ++g) {
                const size_t at = (static_cast<size_t>(r) * H + kvh * group + g) * hd;
                const float* a = acc + static_cast<size_t>(g) * hd;
                if (!bf16) {
                    memcpy(static_cast<float*>(out) + at, a, sizeof(float) * hd);
                    continue;
                }
                uint16_t* o16 = static_cast<uint16_t*>(out) + at;
                int d = 0;
                for (; d + 8 <= hd; d += 8) store_bf16_8(o16 + d, _mm256_loadu_ps(a + d));
                for (; d < hd; ++d) o16[d] = f32_to_bf16(a[d]);
            }
        }
        free(rows);
    }
    free(starts);
}

void ssd_attend_rows(const void* q, int64_t q_stride, const void* kc, const void* vc, void* out, int bf16, int R,
                     int H, int Hkv, int hd, int max_len, const int32_t* slot, const int32_t* len, const int64_t* off,
                     const int64_t* idx, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    attend_rows_part(q, q_stride, kc, vc, out, bf16, R, H, Hkv, hd, max_len, slot, len, off, idx, omp_get_thread_num(),
                     omp_get_num_threads());
}

// y [M, N] = x [M, K] @ w[N, K]^T (+ bias [N]): w fp32, or bf16 when w_bf16 (bias in w's dtype); x and
// y share one dtype (bf16 when x_bf16). Math in fp32, rounded to y's dtype once per output.
void ssd_linear_dense(const void* x, int x_bf16, int M, int N, int K, const void* w, int w_bf16, const void* bias,
                      void* y, int nthreads) {
    DenseInput in = dense_input(x, x_bf16, M, N, K, w_bf16, bias);
#pragma omp parallel num_threads(nthreads)
    dense_part(w, w_bf16, in, M, N, K, y, x_bf16, omp_get_thread_num(), omp_get_num_threads());
    free(in.xf);
    free(in.bias);
}

}  // extern "C"

namespace ssd_team {
namespace {

// Thread 0 prepares the input (`prepare()` returns it on the heap) and hands it out through `shared`; every
// thread fills its share of it (`fill(input)`), then runs `part(input)`; once all are done thread 0 frees it
// (`release(input)`).
template <class Prepare, class Fill, class Part, class Release>
void shared_input(const Team& tm, void** shared, Prepare prepare, Fill fill, Part part, Release release) {
    if (tm.t == 0) *shared = prepare();
    tm.sync();
    auto* input = static_cast<decltype(prepare())>(*shared);
    if (fill(*input)) tm.sync();
    part(*input);
    tm.sync();
    if (tm.t == 0) release(input);
}

}  // namespace

void linears(const Team& tm, void** shared, const void* x, int M, int K, const TeamLinear* ls, int count, int bf16) {
    struct Input {
        QActs a[MAX_TEAM_LINEARS];
    };
    shared_input(
        tm, shared,
        [&] {
            auto* in = new Input;
            for (int i = 0; i < count; ++i) in->a[i] = acts_for(M, K, ls[i].fmt);
            return in;
        },
        [&](Input& in) {
            for (int i = 0; i < count; ++i) quantize_into(x, bf16, M, K, in.a[i], tm.t, tm.nt);
            return true;
        },
        [&](const Input& in) {
            for (int i = 0; i < count; ++i)
                block_gemm_part(ls[i].w, ls[i].scale, ls[i].offset, ls[i].fmt, in.a[i], M, ls[i].n, K, ls[i].y, bf16,
                                ls[i].ldy, tm.t, tm.nt);
        },
        [&](Input* in) {
            for (int i = 0; i < count; ++i) free_acts(in->a[i]);
            delete in;
        });
}

void linear_dense(const Team& tm, void** shared, const void* x, int x_bf16, int M, int N, int K, const void* w,
                  int w_bf16, const void* bias, void* y) {
    shared_input(
        tm, shared, [&] { return new DenseInput(dense_input(x, x_bf16, M, N, K, w_bf16, bias)); },
        [](DenseInput&) { return false; },  // prepared whole by thread 0
        [&](const DenseInput& in) { dense_part(w, w_bf16, in, M, N, K, y, x_bf16, tm.t, tm.nt); },
        [](DenseInput* in) {
            free(in->xf);
            free(in->bias);
            delete in;
        });
}

}  // namespace ssd_team
