#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <stdexcept>
using torch::stable::Tensor;
void throw0() { throw std::runtime_error("probe throw0"); }
Tensor throw1(Tensor x) { STD_TORCH_CHECK(x.dim() == 99, "probe throw1 dim ", x.dim()); return x; }
int64_t throw2(int64_t a) { STD_TORCH_CHECK(a == 99, "probe throw2"); return a; }
int64_t catch3(int64_t a) { try { throw std::runtime_error("inner"); } catch (const std::exception& e) { return 7; } }
STABLE_TORCH_LIBRARY(probe, m) {
  m.def("throw0() -> ()");
  m.def("throw1(Tensor x) -> Tensor");
  m.def("throw2(int a) -> int");
  m.def("catch3(int a) -> int");
}
STABLE_TORCH_LIBRARY_IMPL(probe, CompositeExplicitAutograd, m) {
  m.impl("throw0", TORCH_BOX(&throw0));
  m.impl("throw2", TORCH_BOX(&throw2));
  m.impl("catch3", TORCH_BOX(&catch3));
}
STABLE_TORCH_LIBRARY_IMPL(probe, CPU, m) { m.impl("throw1", TORCH_BOX(&throw1)); }
