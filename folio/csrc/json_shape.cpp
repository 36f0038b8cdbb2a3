// A request body's shape, read from its JSON bytes before Python parses them (folio/server/body_route.py):
// nesting depth, entries per container, NaN/Infinity, lone UTF-16 surrogate escapes.
//
// json.loads of a 4 MiB body of a million one-character prompts holds the interpreter for ~50 ms (every
// string made, the list grown) before folio's own check (request_body.py) can refuse it; the event loop and
// the engine thread wait that long. This scan stops at the first fault (the 65,537th item is ~260 KB into
// such a body), allocates nothing and runs without the GIL. It is a filter in front of that check, with its
// rules (the tests hold them to it): what it passes is still parsed and checked whole; what it cannot read
// (malformed JSON) it passes, for json.loads to refuse with its own message.
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "folio_kernels.h"

namespace {

// Fault kinds, as request_body.py names them: 0 none, then in the order of BODY_FAULTS there.
enum Fault : int64_t { kNone = 0, kTooDeep = 1, kTooManyItems = 2, kNotFinite = 3, kLoneSurrogate = 4 };

struct Frame {
  bool object;
  int64_t count = 0;         // entries (an object's keys) or items started so far
  bool only_ints = true;     // a list: every item so far an integer (token ids pass the item cap)
  bool expect_key = true;    // an object: the next string is a key
  int64_t key_begin = 0, key_end = 0;  // an object: the current entry's key, between its quotes
};

struct Scan {
  const char* p;
  int64_t n;
  int64_t max_depth, max_items;
  std::vector<Frame> stack;
  int64_t fault = kNone, at = 0;
  std::string path;  // where the fault is: keys and indices joined by "."

  // The path of the value being read (`inner`: including its own key or index in the innermost frame).
  void fail(int64_t kind, int64_t offset, bool inner) {
    fault = kind;
    at = offset;
    size_t frames = stack.size();
    for (size_t level = 0; level < frames; ++level) {
      if (level + 1 == frames && !inner) break;
      const Frame& frame = stack[level];
      if (!path.empty()) path += '.';
      if (frame.object) {
        path.append(p + frame.key_begin, p + frame.key_end);
      } else {
        path += std::to_string(frame.count - 1);
      }
    }
  }

  // A value starts in the innermost container; false once a fault is found.
  bool item(bool is_int, int64_t offset) {
    if (stack.empty()) return true;
    Frame& frame = stack.back();
    if (frame.object) return true;  // an object's entries are counted at their keys
    ++frame.count;
    frame.only_ints = frame.only_ints && is_int;
    if (frame.count > max_items && !frame.only_ints) {
      fail(kTooManyItems, offset, false);
      return false;
    }
    return true;
  }

  static int hex(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }

  // A \uXXXX escape at i (the backslash); -1 if it is not one.
  int64_t unit(int64_t i) const {
    if (i + 6 > n || p[i] != '\\' || p[i + 1] != 'u') return -1;
    int64_t value = 0;
    for (int64_t k = 2; k < 6; ++k) {
      int digit = hex(p[i + k]);
      if (digit < 0) return -1;
      value = value * 16 + digit;
    }
    return value;
  }

  // A string from its opening quote at i; returns the index after its closing quote (n if unclosed).
  int64_t string(int64_t i, bool* surrogate) {
    for (++i; i < n; ++i) {
      char c = p[i];
      if (c == '"') return i + 1;
      if (c != '\\') continue;
      int64_t code = unit(i);
      if (code >= 0xD800 && code <= 0xDBFF) {  // a high half needs a low half right after it
        int64_t low = unit(i + 6);
        if (low < 0xDC00 || low > 0xDFFF) *surrogate = true;
        else i += 6;
      } else if (code >= 0xDC00 && code <= 0xDFFF) {
        *surrogate = true;
      }
      ++i;  // the escaped character (or the u of \uXXXX, whose digits are plain characters)
    }
    return n;
  }

  void run() {
    int64_t i = 0;
    while (i < n && fault == kNone) {
      char c = p[i];
      if (c == ' ' || c == '\n' || c == '\r' || c == '\t' || c == ':') {
        ++i;
      } else if (c == ',') {
        if (!stack.empty() && stack.back().object) stack.back().expect_key = true;
        ++i;
      } else if (c == '{' || c == '[') {
        if (!item(false, i)) return;
        if (static_cast<int64_t>(stack.size()) >= max_depth) {
          fail(kTooDeep, i, true);
          return;
        }
        stack.push_back(Frame{c == '{'});
        ++i;
      } else if (c == '}' || c == ']') {
        if (stack.empty()) return;  // malformed: json.loads says how
        stack.pop_back();
        ++i;
      } else if (c == '"') {
        bool surrogate = false;
        int64_t end = string(i, &surrogate);
        bool key = !stack.empty() && stack.back().object && stack.back().expect_key;
        if (key) {
          Frame& frame = stack.back();
          frame.expect_key = false;
          frame.key_begin = i + 1;
          frame.key_end = end > i + 1 ? end - 1 : i + 1;
          if (++frame.count > max_items) {
            fail(kTooManyItems, i, false);
            return;
          }
        } else if (!item(false, i)) {
          return;
        }
        if (surrogate) {
          fail(kLoneSurrogate, i, !key);
          return;
        }
        i = end;
      } else if (c == 'N' || c == 'I' || (c == '-' && i + 1 < n && p[i + 1] == 'I')) {
        if (item(false, i)) fail(kNotFinite, i, true);  // NaN, Infinity, -Infinity: Python reads them, JSON has none
        return;
      } else if (c == '-' || (c >= '0' && c <= '9')) {
        int64_t start = i;
        bool is_int = true;
        for (++i; i < n; ++i) {
          char d = p[i];
          if (d == '.' || d == 'e' || d == 'E') is_int = false;
          else if (!((d >= '0' && d <= '9') || d == '+' || d == '-')) break;
        }
        if (!item(is_int, start)) return;
      } else if (c == 't' || c == 'f' || c == 'n') {
        if (!item(false, i)) return;
        while (i < n && p[i] >= 'a' && p[i] <= 'z') ++i;
      } else {
        return;  // not JSON: json.loads refuses it with its own message
      }
    }
  }
};

// (fault kind, byte offset, path); kind 0 when the body breaks no rule this scan knows.
std::tuple<int64_t, int64_t, std::string> scan_json(const torch::Tensor& body, int64_t max_depth, int64_t max_items) {
  TORCH_CHECK(body.dtype() == torch::kUInt8 && body.dim() == 1 && body.is_contiguous() && body.device().is_cpu(),
              "json_shape: the body is a contiguous 1-D uint8 CPU tensor");
  Scan scan{reinterpret_cast<const char*>(body.data_ptr<uint8_t>()), body.numel(), max_depth, max_items};
  scan.run();
  return {scan.fault, scan.at, scan.path};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("scan_json", &scan_json, py::call_guard<py::gil_scoped_release>(),
        "the first fault in a JSON body: (kind, byte offset, path); kind 0 when there is none",
        py::arg("body"), py::arg("max_depth"), py::arg("max_items"));
  m.attr("entries") = py::dict();  // it publishes nothing for other extensions
}
