// The one exception type pounce throws. Every message names what was wrong ("topk_ids[token 5][k 2] =
// 300 is out of range [0, 256)", "w13 of rank 1 is not 16-byte aligned"), never just "invalid argument".
#pragma once

#include <stdexcept>

namespace pounce {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace pounce
