// tvmamp reference NPU runtime: fp16 storage, fp32 accumulation, written with _Float16.
//
// The kernels emulate an NPU with a 16x16 matrix engine and a 16-lane vector unit on the host
// CPU. Every kernel reads fp16 tensors, converts them to fp32, accumulates in fp32 and rounds
// the result once when it stores fp16 (or stores fp32 when the caller asks for the
// accumulator). Tensors are dense row-major; layouts are NCHW for data and OIHW for weights.
// The library has no TVM dependency: the generated glue code unpacks DLTensors and calls it.
#ifndef TVMAMP_NPU_RUNTIME_H_
#define TVMAMP_NPU_RUNTIME_H_

#include <cstdint>

namespace tvmamp_npu {

using half = _Float16;

// Epilogue activation applied after the bias add.
enum class Act : int { kNone = 0, kRelu = 1, kGelu = 2 };

// Binary elementwise ops with numpy broadcasting.
enum class Binary : int { kAdd = 0, kMultiply = 1 };

constexpr int kMaxRank = 8;

// Broadcast shape of a binary op: rank, the output shape and each input's shape aligned to it.
struct BroadcastShape {
  int rank;
  int64_t out[kMaxRank];
  int64_t a[kMaxRank];
  int64_t b[kMaxRank];
};

// out[batch, m, n] = act(sum_k a[batch, m, k] * b[batch?, k, n] + bias[n]).
// b is [K, N] (or [N, K] when b_transposed); b_batched says whether b has the batch dims of a.
// bias may be null. OutT is half or float.
template <typename OutT>
inline void Matmul(const half* a, const half* b, const half* bias, OutT* out, int64_t batch,
                   int64_t m, int64_t n, int64_t k, bool b_transposed, bool b_batched, Act act);

// NCHW data, OIHW weight, groups 1, dilation 1; pad = {top, left, bottom, right}.
template <typename OutT>
inline void Conv2d(const half* data, const half* weight, const half* bias, OutT* out,
                   const int64_t data_shape[4], const int64_t weight_shape[4],
                   const int64_t out_shape[4], const int64_t strides[2], const int64_t pad[4],
                   Act act);

// NCHW max pooling, dilation 1; padded elements never win.
inline void MaxPool2d(const half* data, half* out, const int64_t data_shape[4],
                      const int64_t out_shape[4], const int64_t pool[2], const int64_t strides[2],
                      const int64_t pad[4]);

inline void BinaryOp(Binary op, const half* a, const half* b, half* out,
                     const BroadcastShape& shape);

inline void Relu(const half* data, half* out, int64_t size);

}  // namespace tvmamp_npu

#endif  // TVMAMP_NPU_RUNTIME_H_
