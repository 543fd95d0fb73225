// Json: a small ordered JSON value, enough for engine_bench's report.
//
//   Json report = Json::Object();
//   report.Set("rows", int64_t{2000000}).Set("engines", Json::Array().Push("rocksdb"));
//   std::puts(report.Dump().c_str());
//
// Thread-safety: a value is used by one thread at a time.
#ifndef KVSPARSE_BENCH_ENGINE_CPP_REPORT_JSON_H_
#define KVSPARSE_BENCH_ENGINE_CPP_REPORT_JSON_H_

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace engine_bench {
// A small ordered JSON value: enough for the report.

class Json {
 public:
  Json() : kind_(Kind::kNull) {}
  // Implicit on purpose: report.Set("rows", n) reads better than Set("rows", Json(n)).
  Json(double value) : kind_(Kind::kNumber), number_(value) {}                  // NOLINT
  Json(int64_t value) : kind_(Kind::kInteger), integer_(value) {}               // NOLINT
  Json(int value) : Json(static_cast<int64_t>(value)) {}                        // NOLINT
  Json(bool value) : kind_(Kind::kBool), integer_(value) {}                     // NOLINT
  Json(const char* value) : kind_(Kind::kString), string_(value) {}             // NOLINT
  Json(std::string value) : kind_(Kind::kString), string_(std::move(value)) {}  // NOLINT

  static Json Object() {
    Json j;
    j.kind_ = Kind::kObject;
    return j;
  }
  static Json Array() {
    Json j;
    j.kind_ = Kind::kArray;
    return j;
  }

  Json& Set(const std::string& key, Json value) {
    members_.emplace_back(key, std::move(value));
    return *this;
  }
  Json& Push(Json value) {
    members_.emplace_back(std::string(), std::move(value));
    return *this;
  }

  std::string Dump(int indent = 0) const {
    std::ostringstream out;
    Write(out, indent);
    return out.str();
  }

 private:
  enum class Kind { kNull, kBool, kInteger, kNumber, kString, kArray, kObject };

  static void Quote(std::ostringstream& out, const std::string& s) {
    out << '"';
    for (char c : s) {
      if (c == '"' || c == '\\') {
        out << '\\' << c;
      } else if (static_cast<unsigned char>(c) < 0x20) {
        char buffer[8];
        std::snprintf(buffer, sizeof(buffer), "\\u%04x", c);
        out << buffer;
      } else {
        out << c;
      }
    }
    out << '"';
  }

  void Write(std::ostringstream& out, int indent) const {
    const std::string pad(static_cast<size_t>(indent + 2), ' ');
    switch (kind_) {
      case Kind::kNull:
        out << "null";
        break;
      case Kind::kBool:
        out << (integer_ ? "true" : "false");
        break;
      case Kind::kInteger:
        out << integer_;
        break;
      case Kind::kNumber:
        if (std::isfinite(number_)) {
          char buffer[32];
          std::snprintf(buffer, sizeof(buffer), "%.6g", number_);
          out << buffer;
        } else {
          out << "null";
        }
        break;
      case Kind::kString:
        Quote(out, string_);
        break;
      case Kind::kArray:
      case Kind::kObject: {
        const bool object = kind_ == Kind::kObject;
        out << (object ? '{' : '[');
        for (size_t i = 0; i < members_.size(); ++i) {
          out << (i ? ",\n" : "\n") << pad;
          if (object) {
            Quote(out, members_[i].first);
            out << ": ";
          }
          members_[i].second.Write(out, indent + 2);
        }
        if (!members_.empty()) out << '\n' << std::string(static_cast<size_t>(indent), ' ');
        out << (object ? '}' : ']');
        break;
      }
    }
  }

  Kind kind_;
  double number_ = 0;
  int64_t integer_ = 0;
  std::string string_;
  std::vector<std::pair<std::string, Json>> members_;
};

}  // namespace engine_bench

#endif  // KVSPARSE_BENCH_ENGINE_CPP_REPORT_JSON_H_
