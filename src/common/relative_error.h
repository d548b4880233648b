// ||got - want|| / ||want|| in double, for tests and the benchmark's cross-checks. NaN anywhere in got
// gives NaN (which fails every "< tolerance" check); a zero `want` gives 0 when got is zero too, else Inf.
#pragma once

#include <cmath>
#include <cstddef>
#include <span>

#include "common/error.h"

namespace pounce {

template <typename A, typename B>
double relative_l2_error(std::span<const A> got, std::span<const B> want) {
  POUNCE_REQUIRE(got.size() == want.size(), "relative_l2_error: ", got.size(), " values against ", want.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = double(got[i]) - double(want[i]);
    num += d * d;
    den += double(want[i]) * double(want[i]);
  }
  if (den == 0) return num == 0 ? 0.0 : INFINITY;
  return std::sqrt(num / den);
}

}  // namespace pounce
