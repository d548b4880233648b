// ||got - want|| / ||want|| in double, for tests and the benchmark's cross-checks. NaN anywhere in got
// gives NaN (which fails every "< tolerance" check); a zero `want` gives 0 when got is zero too, else Inf.
#pragma once

#include <cmath>
#include <cstddef>
#include <span>

#include "common/require.h"

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

// The worst row's relative L2 error: max over rows r of ||got_r - want_r|| / ||want_r||, rows of
// `row_length` values (a token's output). One lost or doubled route moves its token's error to ~1/k
// while barely moving the whole tensor's: this is the check that catches it. NaN in a row gives NaN.
template <typename A, typename B>
double worst_row_error(std::span<const A> got, std::span<const B> want, size_t row_length) {
  POUNCE_REQUIRE(got.size() == want.size() && row_length > 0 && got.size() % row_length == 0,
                 "worst_row_error: ", got.size(), " values against ", want.size(), " in rows of ", row_length);
  double worst = 0;
  for (size_t first = 0; first < got.size(); first += row_length) {
    const double e = relative_l2_error(got.subspan(first, row_length), want.subspan(first, row_length));
    if (!(e <= worst)) worst = e;  // NaN sticks
  }
  return worst;
}

}  // namespace pounce
