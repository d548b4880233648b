#include "bench/shapes.h"

#include <sstream>

#include "common/require.h"

namespace pounce::bench {

const std::vector<MoeModelShape>& shape_catalogue() {
  static const std::vector<MoeModelShape> shapes = {
      //  name                 H      I      E    k   slice E  tokens
      {"deepseek_v3", 7168, 2048, 256, 8, 32, 8192},
      {"kimi_k2", 7168, 2048, 384, 8, 48, 8192},
      {"deepseek_v4_pro", 7168, 3072, 384, 6, 48, 8192},
      {"deepseek_v4_flash", 4096, 2048, 256, 6, 32, 8192},
      {"qwen3_235b", 4096, 1536, 128, 8, 16, 8192},
      // Small experts: all 128 on one GPU, 16384 tokens (~1024 rows per expert).
      {"qwen3_30b", 2048, 768, 128, 8, 128, 16384},
      {"mixtral_8x7b", 4096, 14336, 8, 2, 8, 8192},
  };
  return shapes;
}

std::vector<std::string> shape_names() {
  std::vector<std::string> names;
  for (const auto& s : shape_catalogue()) names.push_back(s.name);
  return names;
}

const MoeModelShape& default_shape() { return shape_catalogue().front(); }

std::vector<MoeModelShape> select_shapes(const std::string& names) {
  if (names == "all") return shape_catalogue();
  std::vector<MoeModelShape> out;
  std::stringstream list(names);
  std::string name;
  while (std::getline(list, name, ',')) {
    bool found = false;
    for (const auto& s : shape_catalogue())
      if (s.name == name) {
        out.push_back(s);
        found = true;
      }
    if (!found) {
      std::string known;
      for (const auto& n : shape_names()) known += " " + n;
      POUNCE_FAIL("unknown shape '", name, "'; known:", known, " (or all)");
    }
  }
  return out;
}

}  // namespace pounce::bench
