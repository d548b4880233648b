// Command-line pieces shared by the benchmark binaries (CLI11).
#pragma once

#include <CLI/CLI.hpp>
#include <limits>
#include <string>
#include <vector>

#include "bench/shapes.h"
#include "common/require.h"
#include "reference/synthetic_routing.h"

namespace pounce::bench {

// Integer options with a lower bound (CLI11's PositiveNumber would print its double range in full).
inline CLI::Validator at_least(int min) {
  return CLI::Range(min, std::numeric_limits<int>::max()).description(">= " + std::to_string(min));
}

// What --routing accepts.
inline std::vector<std::string> routing_names() {
  using reference::RoutingPattern;
  std::vector<std::string> names;
  for (RoutingPattern p : {RoutingPattern::kUniform, RoutingPattern::kZipf, RoutingPattern::kOneExpert,
                           RoutingPattern::kHalfEmpty, RoutingPattern::kBalanced})
    names.push_back(reference::routing_pattern_name(p));
  return names;
}

// --shapes: catalogue names separated by commas, or "all"; select_shapes says what is wrong.
inline const CLI::Validator kShapeList(
    [](const std::string& names) {
      try {
        select_shapes(names);
        return std::string();
      } catch (const Error& e) {
        return std::string(e.what());
      }
    },
    "NAMES|all");

}  // namespace pounce::bench
