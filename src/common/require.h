// Raising pounce::Error from host code. Pure C++: no CUDA headers here, so the host reference and
// planner build and test on machines without a GPU toolkit in the loop.
#pragma once

#include <sstream>
#include <string>

#include "pounce/error.h"

namespace pounce {

namespace detail {
template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}
}  // namespace detail

// Throws pounce::Error with the streamed parts as message: POUNCE_FAIL("rank ", r, " has ", n, " tokens").
#define POUNCE_FAIL(...) throw ::pounce::Error(::pounce::detail::concat(__VA_ARGS__))

// Checks a precondition on user input or configuration; the message must say what is wrong.
#define POUNCE_REQUIRE(cond, ...)          \
  do {                                     \
    if (!(cond)) POUNCE_FAIL(__VA_ARGS__); \
  } while (0)

}  // namespace pounce
