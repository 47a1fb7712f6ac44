// Quantized KV pools (kv_cache_dtype other than auto): the byte layout of kernels/kv_quant.py, written
// and read in place by paged_attention.cpp and group_attention.cpp. A pool is uint8
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
  const c10::BFloat16 scale(amax > 0.0f ? amax / qmax : 1.0f);  // round to nearest even
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

// The row's d values in float32 at out (table: kv_code_table of the pool's format).
inline void dequantize_row(const uint8_t* row, int d, const float* table, float* out) {
  const float s = kv_row_scale(row, d);
  for (int k = 0; k < d; ++k) out[k] = table[row[k]] * s;
}

}  // namespace kvserve
