// The benchmark's shape catalogue: public model configs (docs/design.md §10) and the one-GPU slice each is
// measured at. The slice keeps the per-rank load of expert parallelism over 8 GPUs: E/8 local experts
// and 8192 tokens give the same rows per expert as EP8 with 8192 tokens per rank.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pounce::bench {

struct MoeModelShape {
  std::string name;
  int64_t hidden, intermediate, model_experts, topk;
  int64_t slice_experts, slice_tokens;  // what one GPU runs

  int64_t routes() const { return slice_tokens * topk; }
  // Forward FLOPs of the slice: GEMM1 2*R*H*2I plus GEMM2 2*R*I*H.
  double forward_flops() const { return 6.0 * double(routes()) * double(hidden) * double(intermediate); }
};

const std::vector<MoeModelShape>& shape_catalogue();
std::vector<std::string> shape_names();  // the catalogue's, in its order
const MoeModelShape& default_shape();    // DeepSeek-V3 slice: H 7168, I 2048, 32 experts, 8192 tokens, top-8
// Names separated by commas, or "all". Throws pounce::Error naming an unknown shape.
std::vector<MoeModelShape> select_shapes(const std::string& names);

}  // namespace pounce::bench
