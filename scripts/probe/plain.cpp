#include <torch/library.h>
int64_t plain_throw(int64_t a) { TORCH_CHECK(a == 99, "plain throw"); return a; }
int64_t plain_std(int64_t a) { if (a != 99) throw std::runtime_error("plain std throw"); return a; }
TORCH_LIBRARY(plainprobe, m) { m.def("plain_throw(int a) -> int", &plain_throw); m.def("plain_std(int a) -> int", &plain_std); }
