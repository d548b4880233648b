#include <cmath>
#include <vector>

#include "bench/output_check.h"
#include "common/cuda_check.h"

namespace pounce::bench {

namespace {

constexpr int kThreads = 256;

__device__ double2 add(double2 a, double2 b) { return make_double2(a.x + b.x, a.y + b.y); }

// One block per row; sums in double so that rounding stays far below the errors being measured.
__global__ void __launch_bounds__(kThreads) row_sums_kernel(const __nv_bfloat16* got, const __nv_bfloat16* want,
                                                            int64_t width, const int32_t* row_token, double2* sums) {
  const int64_t row = blockIdx.x;
  double2 s = make_double2(0, 0);
  if (!row_token || row_token[row] >= 0)
    for (int64_t i = threadIdx.x; i < width; i += kThreads) {
      const double g = __bfloat162float(got[row * width + i]), w = __bfloat162float(want[row * width + i]);
      s = add(s, make_double2((g - w) * (g - w), w * w));
    }
  for (int offset = 16; offset > 0; offset /= 2)
    s = add(s, make_double2(__shfl_down_sync(~0u, s.x, offset), __shfl_down_sync(~0u, s.y, offset)));
  __shared__ double2 warp_sums[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) s = add(s, warp_sums[w]);
    sums[row] = s;
  }
}

// ||d|| / ||w|| from squared sums: 0 for two zero rows, Inf for a nonzero difference to a zero row.
double relative(double d2, double w2) { return w2 == 0 ? (d2 == 0 ? 0.0 : INFINITY) : std::sqrt(d2 / w2); }

}  // namespace

void RowComparison::enqueue(const __nv_bfloat16* got, const __nv_bfloat16* want, int64_t width,
                            const int32_t* row_token, cudaStream_t stream) {
  if (sums_.size() == 0) return;
  row_sums_kernel<<<unsigned(sums_.size()), kThreads, 0, stream>>>(got, want, width, row_token, sums_.data());
  CUDA_CHECK_LAUNCH();
}

OutputError RowComparison::error() const {
  const std::vector<double2> sums = sums_.download();
  double d2 = 0, w2 = 0, worst = 0;
  for (const double2& s : sums) {
    d2 += s.x;
    w2 += s.y;
    const double e = relative(s.x, s.y);
    if (!(e <= worst)) worst = e;  // keeps a NaN
  }
  return {relative(d2, w2), worst};
}

}  // namespace pounce::bench
