// A minimal JSON document builder for benchmark results (objects keep insertion order).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace pounce::bench {

class Json {
 public:
  Json() = default;  // null
  Json(bool b) : kind_(Kind::kBool), bool_(b) {}
  Json(double d) : kind_(Kind::kNumber), number_(d) {}
  Json(int v) : Json(double(v)) {}
  Json(int64_t v) : Json(double(v)) {}
  Json(const char* s) : kind_(Kind::kString), string_(s) {}
  Json(std::string s) : kind_(Kind::kString), string_(std::move(s)) {}

  static Json object() { Json j; j.kind_ = Kind::kObject; return j; }
  static Json array() { Json j; j.kind_ = Kind::kArray; return j; }

  // Object member (creates or replaces); the value is returned for nested building.
  Json& operator[](const std::string& key);
  void push_back(Json value);  // array element

  std::string dump(int indent = 2) const;

 private:
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };
  void write(std::string& out, int indent, int depth) const;

  Kind kind_ = Kind::kNull;
  bool bool_ = false;
  double number_ = 0;
  std::string string_;
  std::vector<Json> items_;                           // array elements, or object values
  std::vector<std::string> keys_;                     // object keys, parallel to items_
};

}  // namespace pounce::bench
