// main() of the stand-alone benchmark binaries: runs `run`, and on an error prints "program: what went
// wrong" and exits with 1.
#pragma once

#include <cstdio>
#include <exception>

namespace pounce::bench {

inline int guarded_main(const char* program, int (*run)(int, char**), int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
    return 1;
  }
}

}  // namespace pounce::bench
