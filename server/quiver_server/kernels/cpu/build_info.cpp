// What the loaded kernel library was compiled for, so a test (and the shard's log) can tell which
// vector path actually runs rather than trusting the build flags.

#include <torch/library.h>

#include "vec_width.h"

namespace {

int64_t vector_width() { return quiver_vec::VL; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(quiver_cpu, m) {
  m.def("vector_width() -> int");
  m.impl("vector_width", c10::DispatchKey::CatchAll, &vector_width);
}
