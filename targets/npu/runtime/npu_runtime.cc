// tvmamp reference NPU runtime: kernel bodies (see npu_runtime.h for the contract).
#include "npu_runtime.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

// export_library compiles with -O2; the kernels' inner loops want O3 vectorisation.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("O3")
#endif

namespace tvmamp_npu {

inline std::vector<float> Widen(const half* src, int64_t size) {
  std::vector<float> dst(static_cast<size_t>(size));
  for (int64_t i = 0; i < size; ++i) dst[i] = static_cast<float>(src[i]);
  return dst;
}

inline float Activate(float v, Act act) {
  if (act == Act::kRelu) return v > 0.0f ? v : 0.0f;
  if (act == Act::kGelu) return 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f));
  return v;
}

// b as fp32 [K, N], whatever its stored layout.
inline std::vector<float> PackB(const half* b, int64_t n, int64_t k, bool b_transposed) {
  std::vector<float> packed(static_cast<size_t>(k * n));
  for (int64_t kk = 0; kk < k; ++kk) {
    for (int64_t j = 0; j < n; ++j) {
      packed[kk * n + j] = static_cast<float>(b_transposed ? b[j * k + kk] : b[kk * n + j]);
    }
  }
  return packed;
}

template <typename OutT>
inline void Matmul(const half* a, const half* b, const half* bias, OutT* out, int64_t batch,
                   int64_t m, int64_t n, int64_t k, bool b_transposed, bool b_batched, Act act) {
  std::vector<float> packed, row(static_cast<size_t>(n));
  std::vector<float> bias_f = bias ? Widen(bias, n) : std::vector<float>(n, 0.0f);
  for (int64_t bi = 0; bi < batch; ++bi) {
    if (bi == 0 || b_batched) packed = PackB(b + (b_batched ? bi * k * n : 0), n, k, b_transposed);
    const half* a_mat = a + bi * m * k;
    for (int64_t i = 0; i < m; ++i) {
      std::copy(bias_f.begin(), bias_f.end(), row.begin());
      for (int64_t kk = 0; kk < k; ++kk) {
        const float av = static_cast<float>(a_mat[i * k + kk]);
        const float* b_row = packed.data() + kk * n;
        for (int64_t j = 0; j < n; ++j) row[j] += av * b_row[j];
      }
      OutT* dst = out + (bi * m + i) * n;
      for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<OutT>(Activate(row[j], act));
    }
  }
}

template <typename OutT>
inline void Conv2d(const half* data, const half* weight, const half* bias, OutT* out,
                   const int64_t data_shape[4], const int64_t weight_shape[4],
                   const int64_t out_shape[4], const int64_t strides[2], const int64_t pad[4],
                   Act act) {
  const int64_t c_in = data_shape[1], h = data_shape[2], w = data_shape[3];
  const int64_t c_out = weight_shape[0], kh = weight_shape[2], kw = weight_shape[3];
  const int64_t oh = out_shape[2], ow = out_shape[3];
  const int64_t ph = h + pad[0] + pad[2], pw = w + pad[1] + pad[3];
  std::vector<float> padded(static_cast<size_t>(c_in * ph * pw), 0.0f);
  std::vector<float> wf = Widen(weight, c_out * c_in * kh * kw), acc(oh * ow);
  for (int64_t n = 0; n < data_shape[0]; ++n) {
    const half* src = data + n * c_in * h * w;
    for (int64_t c = 0; c < c_in; ++c)
      for (int64_t y = 0; y < h; ++y)
        for (int64_t x = 0; x < w; ++x)
          padded[(c * ph + y + pad[0]) * pw + x + pad[1]] = static_cast<float>(src[(c * h + y) * w + x]);
    for (int64_t o = 0; o < c_out; ++o) {
      std::fill(acc.begin(), acc.end(), bias ? static_cast<float>(bias[o]) : 0.0f);
      for (int64_t c = 0; c < c_in; ++c)
        for (int64_t r = 0; r < kh; ++r)
          for (int64_t s = 0; s < kw; ++s) {
            const float wv = wf[((o * c_in + c) * kh + r) * kw + s];
            for (int64_t y = 0; y < oh; ++y) {
              const float* in_row = padded.data() + (c * ph + y * strides[0] + r) * pw + s;
              float* acc_row = acc.data() + y * ow;
              for (int64_t x = 0; x < ow; ++x) acc_row[x] += wv * in_row[x * strides[1]];
            }
          }
      OutT* dst = out + (n * c_out + o) * oh * ow;
      for (int64_t i = 0; i < oh * ow; ++i) dst[i] = static_cast<OutT>(Activate(acc[i], act));
    }
  }
}

inline void MaxPool2d(const half* data, half* out, const int64_t data_shape[4],
                      const int64_t out_shape[4], const int64_t pool[2], const int64_t strides[2],
                      const int64_t pad[4]) {
  const int64_t planes = data_shape[0] * data_shape[1], h = data_shape[2], w = data_shape[3];
  const int64_t oh = out_shape[2], ow = out_shape[3];
  for (int64_t p = 0; p < planes; ++p) {
    const half* src = data + p * h * w;
    for (int64_t y = 0; y < oh; ++y)
      for (int64_t x = 0; x < ow; ++x) {
        float best = -std::numeric_limits<float>::infinity();
        for (int64_t r = 0; r < pool[0]; ++r)
          for (int64_t s = 0; s < pool[1]; ++s) {
            const int64_t iy = y * strides[0] + r - pad[0], ix = x * strides[1] + s - pad[1];
            if (iy >= 0 && iy < h && ix >= 0 && ix < w)
              best = std::max(best, static_cast<float>(src[iy * w + ix]));
          }
        out[(p * oh + y) * ow + x] = static_cast<half>(best);
      }
  }
}

// Offset of element `index` (row-major in `out`) in an input of shape `in`, with broadcasting.
inline int64_t BroadcastOffset(int64_t index, const int64_t* out, const int64_t* in, int rank) {
  int64_t offset = 0, stride = 1;
  for (int d = rank - 1; d >= 0; --d) {
    const int64_t coord = index % out[d];
    index /= out[d];
    if (in[d] != 1) offset += coord * stride;
    stride *= in[d];
  }
  return offset;
}

inline void BinaryOp(Binary op, const half* a, const half* b, half* out,
                     const BroadcastShape& shape) {
  int64_t size = 1;
  bool same = true;
  for (int d = 0; d < shape.rank; ++d) {
    size *= shape.out[d];
    same = same && shape.a[d] == shape.out[d] && shape.b[d] == shape.out[d];
  }
  for (int64_t i = 0; i < size; ++i) {
    const int64_t ia = same ? i : BroadcastOffset(i, shape.out, shape.a, shape.rank);
    const int64_t ib = same ? i : BroadcastOffset(i, shape.out, shape.b, shape.rank);
    const float x = static_cast<float>(a[ia]), y = static_cast<float>(b[ib]);
    out[i] = static_cast<half>(op == Binary::kAdd ? x + y : x * y);
  }
}

inline void Relu(const half* data, half* out, int64_t size) {
  for (int64_t i = 0; i < size; ++i) out[i] = data[i] > half(0) ? data[i] : half(0);
}

}  // namespace tvmamp_npu

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
