// Host-side error reporting shared by every module. Pure C++: no CUDA headers here, so the host
// reference and planner build and test on machines without a GPU toolkit in the loop.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace pounce {

// Every error pounce raises on purpose. The message names what was wrong ("topk_ids[token 5][k 2] = 300
// is out of range [0, 256)"), never just "invalid argument".
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

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
#define POUNCE_REQUIRE(cond, ...)  \
  do {                             \
    if (!(cond)) POUNCE_FAIL(__VA_ARGS__); \
  } while (0)

}  // namespace pounce
