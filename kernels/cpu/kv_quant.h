// Quantized KV pools (kv_cache_dtype other than auto): the byte layout of kernels/kv_quant.py, written
// by kv_store.cpp and read in place by paged_attention.cpp and group_attention.cpp. A pool is uint8
// [num_blocks, block_size, kv_heads, head_dim + 2]; each (token, KV head) row is head_dim one-byte
// codes, then the row's scale as a bfloat16 (little-endian), and a value is decode(code) * scale.
// Format ids (kernels.kv_quant.FORMAT_IDS): 0 the model's dtype (not quantized), 1 float8 e4m3fn,
// 2 float8 e5m2, 3 int8.
//
// quantize_row gives exactly the bytes of kernels.kv_quant.quantize: amax in float32, scale =
// bfloat16(amax / qmax) rounded to nearest even (1 for a row of zeros), codes = x / float(scale)
// clamped to [-qmax, qmax] and rounded to nearest even (c10's float8 constructors, as torch's .to();
// int8 by std::nearbyint in the default rounding mode, as torch.round). No FMA can enter: there is no
// add. dequantize_row is codes.float() * scale: one float32 product per value.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include "vec.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvserve {

constexpr int kKvFormats = 4;     // ids 0 .. 3
constexpr int kKvScaleBytes = 2;  // the bfloat16 scale after a row's codes

inline float kv_qmax(int fmt) { return fmt == 1 ? 448.0f : fmt == 2 ? 57344.0f : 127.0f; }

// The float value of each of the 256 codes of format fmt (1 .. 3), built once.
inline const float* kv_code_table(int fmt) {
  struct Tables {
    float t[kKvFormats][256];
    Tables() {
      for (int c = 0; c < 256; ++c) {
        t[0][c] = 0.0f;
        t[1][c] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(c), c10::Float8_e4m3fn::from_bits()));
        t[2][c] = static_cast<float>(c10::Float8_e5m2(static_cast<uint8_t>(c), c10::Float8_e5m2::from_bits()));
        t[3][c] = static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(c)));
      }
    }
  };
  static const Tables tables;
  return tables.t[fmt];
}

inline float kv_to_float(float x) { return x; }
inline float kv_to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float kv_to_float(c10::Half x) { return static_cast<float>(x); }

// The row x[0 .. d) -> its d + 2 bytes at out.
template <typename T>
inline void quantize_row(const T* x, int d, int fmt, uint8_t* out) {
  const float qmax = kv_qmax(fmt);
  float amax = 0.0f;
  for (int k = 0; k < d; ++k) amax = std::max(amax, std::fabs(kv_to_float(x[k])));
  c10::BFloat16 scale(amax / qmax);  // round to nearest even
  if (!(static_cast<float>(scale) > 0.0f)) scale = c10::BFloat16(1.0f);  // zeros, or a scale rounded to 0
  const float s = static_cast<float>(scale);
  for (int k = 0; k < d; ++k) {
    const float y = std::min(std::max(kv_to_float(x[k]) / s, -qmax), qmax);
    if (fmt == 1)
      out[k] = c10::Float8_e4m3fn(y).x;
    else if (fmt == 2)
      out[k] = c10::Float8_e5m2(y).x;
    else
      out[k] = static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(y)));
  }
  std::memcpy(out + d, &scale.x, kKvScaleBytes);
}

// The row's scale, from its bfloat16 bytes after the codes.
inline float kv_row_scale(const uint8_t* row, int d) {
  uint16_t bits;
  std::memcpy(&bits, row + d, kKvScaleBytes);
  const uint32_t f = static_cast<uint32_t>(bits) << 16;
  float s;
  std::memcpy(&s, &f, sizeof(s));
  return s;
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
// W codes at p as floats (dequantize_row): e5m2's exact values, e4m3fn's times 2^-8, int8's.
#if defined(__AVX512F__)
inline vf kv_halves_e5m2(const uint8_t* p) {
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(c), 8);
  return reinterpret_cast<vf>(_mm512_cvtph_ps(h));
}
inline vf kv_halves_e4m3(const uint8_t* p) {
  const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x7f)), 7));
  return reinterpret_cast<vf>(_mm512_cvtph_ps(h));
}
inline vf kv_int8(const uint8_t* p) {
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<vf>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)));
}
#else
inline vf kv_halves_e5m2(const uint8_t* p) {
  const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i h = _mm_slli_epi16(_mm_cvtepu8_epi16(c), 8);
  return reinterpret_cast<vf>(_mm256_cvtph_ps(h));
}
inline vf kv_halves_e4m3(const uint8_t* p) {
  const __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(c, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(c, _mm_set1_epi16(0x7f)), 7));
  return reinterpret_cast<vf>(_mm256_cvtph_ps(h));
}
inline vf kv_int8(const uint8_t* p) {
  const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<vf>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)));
}
#endif
#endif


#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
#define KVSERVE_KV_VECTORS 1
// A row's W-code groups as float32 vectors, dequantize_row's values (below): KvRowReader(row, d, fmt),
// then at(c) for the codes [c * W, c * W + W). The attention's decode path converts each key row into
// registers with it, where the scores use it, rather than through a scratch row.
struct KvRowReader {
  const uint8_t* row;
  int fmt;
  bool unfolded;  // e4m3fn with a scale 256 s would overflow: (h * 256) * s, else h * (256 s)
  vf scale;
  KvRowReader(const uint8_t* r, int d, int f) : row(r), fmt(f), unfolded(false) {
    float s = kv_row_scale(r, d);
    if (f == 1) {
      const float s256 = s * 256.0f;
      unfolded = !std::isfinite(s256) && std::isfinite(s);
      if (!unfolded) s = s256;
    }
    scale = vsplat(s);
  }
  vf at(int c) const {
    const uint8_t* p = row + c * W;
    if (fmt == 1) return (unfolded ? kv_halves_e4m3(p) * 256.0f : kv_halves_e4m3(p)) * scale;
    if (fmt == 2) return kv_halves_e5m2(p) * scale;
    return kv_int8(p) * scale;
  }
};
#endif

// The row's d values in float32 at out (fmt: the pool's format 1 .. 3; table: kv_code_table(fmt), for
// the scalar path). Bit for bit table[code] * scale, W codes at a time on x86 (AVX-512, or AVX2 with
// F16C as in x86-64-v3), the last d % W (and every code elsewhere) through the table:
// - e5m2: a code is the high byte of an IEEE half; code << 8 converted to float (vcvtph2ps) is its
//   value exactly.
// - e4m3fn: sign << 15 | (code & 0x7f) << 7 read as a half is the code's value times 2^-8 exactly,
//   subnormals included (a half's exponent bias is 15, e4m3's 7; a zero exponent field is a half
//   subnormal with the same 2^-8 scaling), and 256 is folded into the scale: h * (256 s) and
//   (256 h) * s are the one float32 rounding of the same real product, since 256 h (at most 480) is
//   exact and so is 256 s unless it overflows, which a finite scale of kv_quant's (at most
//   bfloat16(FLT_MAX / 448) < 2^120) never does; a larger finite scale is multiplied in twice. The
//   NaN codes 0x7f / 0xff, which quantize_row writes only for a NaN input (it clamps to +-448), come out as
//   +-480 * scale from the vector lanes (the table's NaN in the scalar tail).
// - int8: sign-extended to int32 and converted, exactly.
// No add anywhere, so no FMA contraction can change a product.
inline void dequantize_row(const uint8_t* row, int d, int fmt, const float* table, float* out) {
  const float s = kv_row_scale(row, d);
  int k = 0;
#ifdef KVSERVE_KV_VECTORS
  const KvRowReader reader(row, d, fmt);
  for (; k + W <= d; k += W) vstore(out + k, reader.at(k / W));
#else
  (void)fmt;
#endif
  for (; k < d; ++k) out[k] = table[row[k]] * s;
}

}  // namespace kvserve
