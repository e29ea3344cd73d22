// Whole decoder layers (Llama / Qwen2: RMSNorm, fused qkv, RoPE, KV write, attention, o_proj, residual,
// RMSNorm, fused gate/up, SiLU * up, down, residual) for T new tokens in one C call, so a decode step
// pays one Python -> C transition instead of ~20 small torch ops per layer.
//
// Every step is the kernel or the formula the torch path (workers/models/decoder.py with the CPU
// kernels) uses, rounded to the activation dtype where torch rounds, so both paths give the same
// bits; every step is also row-independent, so scoring K+1 tokens gives each token the bits it
// gets when decoded alone.

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include <initializer_list>

#include "common.h"

extern "C" {

// Mirrors ssd.kernels.cpu.LinearDesc (ctypes).
struct SsdLinear {
    int32_t kind;  // 0: dense fp32/bf16 weights; block: 1 q4 (w4a8), 2 q8 (w8a8), 3 q5 (Q5_0), 4 q6 (Q6_K), 5 q4g64
    int32_t n, k;
    int32_t w_bf16;          // dense: weights (and bias) are bf16
    const void* w;           // dense weight [N, K], or block codes
    const uint16_t* scale;   // block: fp16 scales as qgemm.cpp reads them (q8: [N, K/32])
    const uint16_t* offset;  // q4: as scale
    const void* bias;        // dense: in w's dtype, added in fp32 before rounding; block: activation dtype, after
};

// Mirrors ssd.kernels.cpu.LayerDesc.
struct SsdLayer {
    SsdLinear q, k, v;   // qkv_parts == 1: q is the fused q/k/v projection (k, v unused)
    int32_t qkv_parts;   // 1 or 3 (q, k, v quantised differently, e.g. from a Q4_K_M GGUF)
    SsdLinear o, gate_up, down;
    const void* in_norm;    // [D], activation dtype
    const void* post_norm;  // [D]
    void* k_cache;          // this layer's [S, Hkv, max_len, hd], activation dtype
    void* v_cache;
};

// y = silu(gu[:, :I]) * gu[:, I:] per row, each op rounded to the dtype as torch's F.silu(gate) * up:
// silu(g) = g / (1 + exp(-g)) in fp32, with exp computed 8 lanes at a time (exp8: within ~2 ulp of
// libm's expf, the same bits in every build and for every element whatever its position).
// Thread t of nt: its contiguous share of the 8-column chunks.
static void silu_mul_part(const void* gu, void* y, int bf16, int M, int I, int t, int nt) {
    const int chunks = (I + 7) / 8;
    const int64_t jobs = static_cast<int64_t>(M) * chunks;
    for (int64_t job = jobs * t / nt; job < jobs * (t + 1) / nt; ++job) {
        const int64_t m = job / chunks;
        const int i0 = static_cast<int>(job % chunks) * 8, n = I - i0 < 8 ? I - i0 : 8;
        const int64_t at_g = m * 2 * I + i0, at_u = at_g + I, at_y = m * I + i0;
        alignas(32) float g[8] = {}, u[8] = {}, out[8];
        if (n == 8) {
            load8(gu, at_g, bf16, g);
            load8(gu, at_u, bf16, u);
        } else {
            for (int j = 0; j < n; ++j) {
                g[j] = act_load(gu, at_g + j, bf16);
                u[j] = act_load(gu, at_u + j, bf16);
            }
        }
        const __m256 gv = _mm256_load_ps(g);
        __m256 sv = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
        if (bf16) sv = round_bf16_8(sv);
        const __m256 yv = _mm256_mul_ps(sv, _mm256_load_ps(u));
        if (n == 8 && bf16) {
            store_bf16_8(static_cast<uint16_t*>(y) + at_y, yv);
        } else if (n == 8) {
            _mm256_storeu_ps(static_cast<float*>(y) + at_y, yv);
        } else {
            _mm256_store_ps(out, yv);
            for (int j = 0; j < n; ++j) act_store(y, at_y + j, out[j], bf16);
        }
    }
}

void ssd_silu_mul(const void* gu, void* y, int bf16, int M, int I, int nthreads) {
    const int64_t jobs = static_cast<int64_t>(M) * ((I + 7) / 8);
#pragma omp parallel num_threads(nthreads) if (jobs >= 512)
    silu_mul_part(gu, y, bf16, M, I, omp_get_thread_num(), omp_get_num_threads());
}

}  // extern "C"

namespace {

ssd_team::TeamLinear team_linear(const SsdLinear& l, void* y, int ldy) {
    return {l.kind, l.n, static_cast<const uint8_t*>(l.w), l.scale, l.kind == 1 || l.kind == 5 ? l.offset : nullptr, y, ldy};
}

// y[:, :l.n] (rows ldy apart) += l's bias in the activation dtype, as _BlockLinear.forward's y.add_(bias).
void add_bias(const SsdLinear& l, void* y, int ldy, int M, int bf16) {
    for (int m = 0; m < M; ++m)
        for (int n = 0; n < l.n; ++n) {
            const size_t at = static_cast<size_t>(m) * ldy + n;
            act_store(y, at, act_load(y, at, bf16) + act_load(l.bias, n, bf16), bf16);
        }
}

// One linear layer run by the team (y complete and the team in step on return).
void run_linear(const Team& tm, void** shared, const SsdLinear& l, const void* x, int M, void* y, int bf16) {
    if (l.kind == 0) {
        ssd_team::linear_dense(tm, shared, x, bf16, M, l.n, l.k, l.w, l.w_bf16, l.bias, y);
        return;
    }
    const ssd_team::TeamLinear tl = team_linear(l, y, l.n);
    ssd_team::linears(tm, shared, x, M, l.k, &tl, 1, bf16);
    if (l.bias == nullptr) return;
    if (tm.t == 0) add_bias(l, y, l.n, M, bf16);
    tm.sync();
}

// x += d elementwise, rounded (the residual adds).
void add_into(void* x, const void* d, size_t count, int bf16) {
    for (size_t i = 0; i < count; ++i) act_store(x, i, act_load(x, i, bf16) + act_load(d, i, bf16), bf16);
}

// The layers for one team member: the elementwise steps (norms, RoPE, the cache writes, residual adds)
// on thread 0, the linears and attention shared; sync() between the stages. `buf`: the work buffers.
void layers_team(const Team& tm, void** shared, char* buf, const SsdLayer* layers, int n_layers, void* x, int bf16,
                 int T, int D, int H, int Hkv, int hd, int I, int max_len, float eps, const void* cos, const void* sin,
                 const int32_t* w_slot, const int32_t* w_pos, const int32_t* slot, const int32_t* len,
                 const int64_t* off, const int64_t* idx) {
    const size_t es = bf16 ? 2 : 4;
    const int qkv_w = (H + 2 * Hkv) * hd, half = hd / 2;
    void* h = buf;                                      // [T, D] normed input
    void* qkv = buf + es * T * D;                       // [T, (H + 2 Hkv) hd]
    void* att = static_cast<char*>(qkv) + es * T * qkv_w;  // [T, H hd]
    void* o = static_cast<char*>(att) + es * T * H * hd;   // [T, D]
    void* gu = static_cast<char*>(o) + es * T * D;         // [T, 2 I]
    void* act = static_cast<char*>(gu) + es * T * 2 * I;   // [T, I]
    auto serial = [&](auto&& step) {
        if (tm.t == 0) step();
        tm.sync();
    };
    for (int li = 0; li < n_layers; ++li) {
        const SsdLayer& L = layers[li];
        serial([&] { ssd_rmsnorm(x, L.in_norm, h, bf16, T, D, eps); });
        if (L.qkv_parts == 1) {
            run_linear(tm, shared, L.q, h, T, qkv, bf16);
        } else if (L.q.kind != 0 && L.k.kind != 0 && L.v.kind != 0) {
            // q, k and v quantised differently: one stage, each straight into its columns of qkv.
            const size_t cols[3] = {0, static_cast<size_t>(L.q.n), static_cast<size_t>(L.q.n + L.k.n)};
            const SsdLinear* parts[3] = {&L.q, &L.k, &L.v};
            ssd_team::TeamLinear tls[3];
            for (int i = 0; i < 3; ++i) tls[i] = team_linear(*parts[i], static_cast<char*>(qkv) + es * cols[i], qkv_w);
            ssd_team::linears(tm, shared, h, T, D, tls, 3, bf16);
            if (L.q.bias != nullptr || L.k.bias != nullptr || L.v.bias != nullptr)
                serial([&] {
                    for (int i = 0; i < 3; ++i)
                        if (parts[i]->bias != nullptr) add_bias(*parts[i], tls[i].y, qkv_w, T, bf16);
                });
        } else {  // each part into `att` (free until attention), then into its columns of qkv
            int col = 0;
            for (const SsdLinear* part : {&L.q, &L.k, &L.v}) {
                run_linear(tm, shared, *part, h, T, att, bf16);
                serial([&] {
                    for (int t = 0; t < T; ++t)
                        memcpy(static_cast<char*>(qkv) + (static_cast<size_t>(t) * qkv_w + col) * es,
                               static_cast<char*>(att) + static_cast<size_t>(t) * part->n * es, part->n * es);
                });
                col += part->n;
            }
        }
        serial([&] {
            // RoPE on the q and k heads: out = x * cos + rotate_half(x) * sin, each op rounded.
            for (int t = 0; t < T; ++t)
                for (int head = 0; head < H + Hkv; ++head) {
                    const size_t at = static_cast<size_t>(t) * qkv_w + static_cast<size_t>(head) * hd;
                    float v[512];  // hd <= 512 (checked by the caller)
                    for (int d = 0; d < hd; ++d) v[d] = act_load(qkv, at + d, bf16);
                    for (int d = 0; d < hd; ++d) {
                        const float c = act_load(cos, static_cast<size_t>(t) * hd + d, bf16);
                        const float s = act_load(sin, static_cast<size_t>(t) * hd + d, bf16);
                        const float rot = d < half ? -v[d + half] : v[d - half];
                        float a = v[d] * c, b = rot * s;
                        if (bf16) {
                            a = bf16_to_f32(f32_to_bf16(a));
                            b = bf16_to_f32(f32_to_bf16(b));
                        }
                        act_store(qkv, at + d, a + b, bf16);
                    }
                }
            // Keys and values of every new token into the cache before any token attends.
            for (int t = 0; t < T; ++t)
                for (int kh = 0; kh < Hkv; ++kh) {
                    const size_t dst = ((static_cast<size_t>(w_slot[t]) * Hkv + kh) * max_len + w_pos[t]) * hd * es;
                    const size_t src = (static_cast<size_t>(t) * qkv_w + static_cast<size_t>(H + kh) * hd) * es;
                    memcpy(static_cast<char*>(L.k_cache) + dst, static_cast<char*>(qkv) + src, hd * es);
                    memcpy(static_cast<char*>(L.v_cache) + dst, static_cast<char*>(qkv) + src + Hkv * hd * es, hd * es);
                }
        });
        attend_rows_part(qkv, qkv_w, L.k_cache, L.v_cache, att, bf16, T, H, Hkv, hd, max_len, slot, len, off, idx,
                         tm.t, tm.nt);
        tm.sync();
        run_linear(tm, shared, L.o, att, T, o, bf16);
        serial([&] {
            add_into(x, o, static_cast<size_t>(T) * D, bf16);
            ssd_rmsnorm(x, L.post_norm, h, bf16, T, D, eps);
        });
        run_linear(tm, shared, L.gate_up, h, T, gu, bf16);
        silu_mul_part(gu, act, bf16, T, I, tm.t, tm.nt);
        tm.sync();
        run_linear(tm, shared, L.down, act, T, o, bf16);
        serial([&] { add_into(x, o, static_cast<size_t>(T) * D, bf16); });
    }
}

}  // namespace

extern "C" {

// x [T, D] (in place): the hidden states of T new tokens through `n_layers` layers. Token t sits at
// cache slot w_slot[t], position w_pos[t]; cos/sin [T, hd] are its RoPE rows; (slot, len, off, idx)
// is the attention plan of ssd_attend_rows, one entry per token in the same order. One OpenMP region
// for the whole call, its stages separated by a spin barrier (see SpinBarrier).
void ssd_decoder_layers(const SsdLayer* layers, int n_layers, void* x, int bf16, int T, int D, int H, int Hkv, int hd,
                        int I, int max_len, float eps, const void* cos, const void* sin, const int32_t* w_slot,
                        const int32_t* w_pos, const int32_t* slot, const int32_t* len, const int64_t* off,
                        const int64_t* idx, int nthreads) {
    const size_t es = bf16 ? 2 : 4;
    const int qkv_w = (H + 2 * Hkv) * hd;
    char* buf = static_cast<char*>(malloc(es * T * (2 * static_cast<size_t>(D) + qkv_w + H * hd + 3 * I)));
    void* shared = nullptr;
    auto run = [&](const Team& tm) {
        layers_team(tm, &shared, buf, layers, n_layers, x, bf16, T, D, H, Hkv, hd, I, max_len, eps, cos, sin, w_slot,
                    w_pos, slot, len, off, idx);
    };
    if (nthreads <= 1) {
        run(Team{0, 1, nullptr});
    } else {
        SpinBarrier barrier(nthreads);
#pragma omp parallel num_threads(nthreads)
        {
            // A smaller team than asked for (a nested call): its thread 0 runs every stage alone.
            if (omp_get_num_threads() == nthreads)
                run(Team{omp_get_thread_num(), nthreads, &barrier});
            else if (omp_get_thread_num() == 0)
                run(Team{0, 1, nullptr});
        }
    }
    free(buf);
}

}  // extern "C"
