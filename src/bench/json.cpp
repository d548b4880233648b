#include "bench/json.h"

#include <cmath>
#include <cstdio>

#include "bench/bench.h"
#include "common/require.h"

namespace pounce::bench {

Json timing_json(const Timing& t) {
  Json j = Json::object();
  j["median_ms"] = t.median_ms;
  j["p10_ms"] = t.p10_ms;
  j["p90_ms"] = t.p90_ms;
  j["min_ms"] = t.min_ms;
  j["reps"] = t.reps;
  return j;
}

Json& Json::operator[](const std::string& key) {
  if (kind_ == Kind::kNull) kind_ = Kind::kObject;
  POUNCE_REQUIRE(kind_ == Kind::kObject, "json: member '", key, "' of a non-object");
  for (size_t i = 0; i < keys_.size(); ++i)
    if (keys_[i] == key) return items_[i];
  keys_.push_back(key);
  items_.emplace_back();
  return items_.back();
}

void Json::push_back(Json value) {
  if (kind_ == Kind::kNull) kind_ = Kind::kArray;
  POUNCE_REQUIRE(kind_ == Kind::kArray, "json: push_back on a non-array");
  items_.push_back(std::move(value));
}

static void write_string(std::string& out, const std::string& s) {
  out += '"';
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

void Json::write(std::string& out, int indent, int depth) const {
  const std::string pad(size_t(indent) * (depth + 1), ' '), end_pad(size_t(indent) * depth, ' ');
  switch (kind_) {
    case Kind::kNull: out += "null"; break;
    case Kind::kBool: out += bool_ ? "true" : "false"; break;
    case Kind::kNumber: {
      if (!std::isfinite(number_)) { out += "null"; break; }  // JSON has no NaN/Inf
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.10g", number_);
      out += buf;
      break;
    }
    case Kind::kString: write_string(out, string_); break;
    case Kind::kArray:
    case Kind::kObject: {
      const bool is_object = kind_ == Kind::kObject;
      out += is_object ? '{' : '[';
      for (size_t i = 0; i < items_.size(); ++i) {
        out += i ? ",\n" : "\n";
        out += pad;
        if (is_object) {
          write_string(out, keys_[i]);
          out += ": ";
        }
        items_[i].write(out, indent, depth + 1);
      }
      if (!items_.empty()) out += "\n" + end_pad;
      out += is_object ? '}' : ']';
      break;
    }
  }
}

std::string Json::dump(int indent) const {
  std::string out;
  write(out, indent, 0);
  out += '\n';
  return out;
}

}  // namespace pounce::bench
