// Shared by the CPU kernel sources: bf16 conversions (as torch does them) and the C entry points one
// source calls in another (all compiled into one library by ssd.kernels.cpu).
#pragma once

#include <stdint.h>
#include <string.h>

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

extern "C" {
void ssd_linear(const void* x, int M, int N, int K, const uint8_t* w, const uint16_t* scale, const uint16_t* offset,
                int fmt, void* y, int bf16, int nthreads);
void ssd_linear_dense(const void* x, int x_bf16, int M, int N, int K, const void* w, int w_bf16, const void* bias,
                      void* y, int nthreads);
void ssd_rmsnorm(const void* x, const void* weight, void* out, int bf16, int M, int D, float eps);
void ssd_attend_rows(const void* q, int64_t q_stride, const void* kc, const void* vc, void* out, int bf16, int R,
                     int H, int Hkv, int hd, int max_len, const int32_t* slot, const int32_t* len, const int64_t* off,
                     const int64_t* idx, int nthreads);
}
