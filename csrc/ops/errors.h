// Errors of the ops (csrc/ops/): nothing here throws. On torch 2.11 a C++ exception thrown inside a stable-ABI
// kernel's library kills the process (even one caught there). A check that fails returns an Error, which the
// registered kernels (csrc/ops.cpp) hand to Python as a string ("<Python exception type>|<message>"), and
// flashattn_ext/ops.py raises it.
#pragma once
#include <cstdio>
#include <string>
#include <type_traits>

namespace flashattn::ops {

struct [[nodiscard]] Error {
  std::string message;  // empty: no error
  explicit operator bool() const { return !message.empty(); }
};

// Message pieces as text. Numbers go through std::to_string and snprintf, not iostreams: on
// the torch 2.11 builds whose processes crash on an exception, formatting a number through a
// std::ostream crashed as well.
inline std::string to_text(const char* s) { return s; }
inline std::string to_text(const std::string& s) { return s; }
inline std::string to_text(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", x);
  return text;
}
template <class T, class = std::enable_if_t<std::is_integral_v<T>>>
std::string to_text(T x) {
  return std::to_string(x);
}

template <class... Args>
Error error_of(const char* kind, const Args&... args) {
  std::string message = std::string(kind) + "|";
  ((message += to_text(args)), ...);
  return Error{message};
}

}  // namespace flashattn::ops

// Returns the error (a RuntimeError in Python) from the enclosing function when cond is false.
#define FA_CHECK(cond, ...)                                       \
  do {                                                            \
    if (!(cond)) return error_of("RuntimeError", __VA_ARGS__);    \
  } while (0)
// Returns from the enclosing function the error of a call that failed.
#define FA_TRY(call)                    \
  do {                                  \
    if (Error e_ = (call)) return e_;   \
  } while (0)
