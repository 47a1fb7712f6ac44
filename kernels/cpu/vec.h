// Float vectors through GCC/Clang vector extensions, as wide as the machine's registers: 16 lanes in
// one AVX-512 register where the compiler targets AVX-512 (the code is compiled with -march=native),
// else 8 lanes in one AVX2 register (on NEON, a pair). Wider-than-hardware vectors would be split by
// the compiler, which doubles every register tile and spills. Also the exp that the softmax and SiLU
// need, vectorised.
#pragma once

#include <algorithm>
#include <cstdint>

namespace kvserve {

#if defined(__AVX512F__)
constexpr int W = 16;  // lanes of a vector
constexpr int kVectorRegisters = 32;
#else
constexpr int W = 8;
constexpr int kVectorRegisters = 16;
#endif

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

inline vf vload(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
inline void vstore(float* p, vf v) { __builtin_memcpy(p, &v, sizeof(v)); }
inline vf vsplat(float x) { return vf{} + x; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline float hsum(vf v) {
  typedef float v4 __attribute__((vector_size(16)));
#if defined(__AVX512F__)
  typedef float v8 __attribute__((vector_size(32)));
  v8 lo, hi;
  __builtin_memcpy(&lo, &v, 32);
  __builtin_memcpy(&hi, reinterpret_cast<const char*>(&v) + 32, 32);
  v8 s8 = lo + hi;
#else
  const vf s8 = v;
#endif
  v4 a, b;
  __builtin_memcpy(&a, &s8, 16);
  __builtin_memcpy(&b, reinterpret_cast<const char*>(&s8) + 16, 16);
  v4 s4 = a + b;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}
// Lane indices 0, 1, ..., W - 1.
inline vi iota() {
  vi v;
  for (int i = 0; i < W; ++i) v[i] = i;
  return v;
}
// Lanes of a and b picked by constant indices (0 .. W - 1: a's, W .. 2W - 1: b's). GCC has
// __builtin_shufflevector from version 12 only; older GCC (11 on Ubuntu 22.04 and RHEL 9) has
// __builtin_shuffle, which takes the indices as a vector.
#if defined(__clang__) || __GNUC__ >= 12
#define KVSERVE_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define KVSERVE_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, vi{__VA_ARGS__})
#endif
// W vectors in, one out: lane j holds the sum of v[j]'s lanes. Levels of pairing (adjacent lanes,
// then pairs, quads, ...) keep every vector full: W - 1 shuffle pairs and adds instead of a
// horizontal sum per vector.
#if defined(__AVX512F__)
inline vf pair_sum(vf a, vf b) {
  return KVSERVE_SHUFFLE(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         KVSERVE_SHUFFLE(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
inline vf transpose_sum(const vf* v) {
  vf a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) a[i] = pair_sum(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 4; ++i) b[i] = pair_sum(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 2; ++i) c[i] = pair_sum(b[2 * i], b[2 * i + 1]);
  return pair_sum(c[0], c[1]);
}
#else
inline vf pair_sum(vf a, vf b) {
  return KVSERVE_SHUFFLE(a, b, 0, 2, 4, 6, 8, 10, 12, 14) + KVSERVE_SHUFFLE(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
}
inline vf transpose_sum(const vf* v) {
  vf a[4], b[2];
  for (int i = 0; i < 4; ++i) a[i] = pair_sum(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 2; ++i) b[i] = pair_sum(a[2 * i], a[2 * i + 1]);
  return pair_sum(b[0], b[1]);
}
#endif
inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = std::max(m, v[i]);
  return m;
}

// exp(x) for x <= 0 (scores minus their running maximum): 2^t with t = x log2(e) split into an
// integer n (round to nearest by the 1.5 * 2^23 trick) and f in [-0.5, 0.5]; e^(f ln 2) by its
// degree-7 Taylor polynomial (relative error < 1e-8), 2^n through the exponent bits. Anything below
// -87 (exp(-inf) included) gives exactly 0.
inline vf vexp(vf x) {
  const vf lo = vsplat(-87.0f);
  const vf xc = x < lo ? lo : x;
  const vf t = xc * 1.4426950408889634f;
  const vf n = (t + 12582912.0f) - 12582912.0f;
  const vf f = (t - n) * 0.6931471805599453f;
  vf p = vsplat(1.0f / 5040.0f);
  p = p * f + 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return x < lo ? vsplat(0.0f) : p * scale;
}
inline float sexp(float x) { return vexp(vsplat(x))[0]; }

// silu(x) = x * sigmoid(x), with e = exp(-|x|) <= 1 so that vexp covers every x.
inline vf vsilu(vf x) {
  const vf zero = vsplat(0.0f);
  const vf e = vexp(x > zero ? -x : x);
  const vf sig = (x > zero ? vsplat(1.0f) : e) / (1.0f + e);
  return x * sig;
}
inline float ssilu(float x) { return vsilu(vsplat(x))[0]; }

// tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) <= 1, so that vexp covers every x (the
// soft-capping of attention scores: cap * tanh(s / cap)).
inline vf vtanh(vf x) {
  const vf zero = vsplat(0.0f);
  const vf e = vexp(x > zero ? -2.0f * x : 2.0f * x);
  const vf t = (1.0f - e) / (1.0f + e);
  return x < zero ? -t : t;
}

}  // namespace kvserve
