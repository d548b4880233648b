// Small numerics shared by the host reference.
#pragma once

#include <cmath>

namespace pounce::reference {

// exp() only ever sees a non-positive argument, so large |v| cannot overflow.
inline double stable_sigmoid(double v) {
  if (v >= 0) return 1.0 / (1.0 + std::exp(-v));
  const double z = std::exp(v);
  return z / (1.0 + z);
}

}  // namespace pounce::reference
