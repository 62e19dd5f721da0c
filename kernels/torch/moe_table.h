// The table the moe_experts operators take (schema in ops.cpp): for every expert of the layer, 0 (not
// in this call) or 1 followed by its gate, up and down, each [buffer index (-1: none, e.g. no up when
// gate holds gate|up), n, the matrix in n ints]. Read here once for the CPU operator (ops.cpp) and the
// CUDA one (cuda/ops_cuda.cpp), which then build their own matrices from each entry.
#pragma once

#include <torch/library.h>

#include <vector>

namespace mf {

struct TableMatrix {
  int64_t buffer = -1;  // index into the operator's buffers, or -1 (none)
  at::IntArrayRef spec;
};

struct TableExpert {
  bool present = false;
  TableMatrix gate, up, down;
};

// Every expert's entry, checked for its structure (one line naming what is wrong).
inline std::vector<TableExpert> read_moe_table(at::IntArrayRef table, size_t n_buffers) {
  std::vector<TableExpert> out;
  size_t at = 0;
  auto next = [&](const char* what) -> int64_t {
    TORCH_CHECK(at < table.size(), "moe_experts: the table ends inside ", what);
    return table[at++];
  };
  while (at < table.size()) {
    const int64_t present = next("an expert");
    TORCH_CHECK(present == 0 || present == 1, "moe_experts: an expert starts with 0 (absent) or 1");
    TableExpert e;
    e.present = present == 1;
    if (e.present)
      for (TableMatrix* m : {&e.gate, &e.up, &e.down}) {
        m->buffer = next("an expert");
        const int64_t n = next("a matrix");
        TORCH_CHECK(n >= 0 && at + n <= table.size(), "moe_experts: the table ends inside a matrix");
        m->spec = at::IntArrayRef(table.data() + at, n);
        at += n;
        TORCH_CHECK(m->buffer < (int64_t)n_buffers, "moe_experts: an expert's buffer index is past the buffers");
      }
    out.push_back(e);
  }
  return out;
}

}  // namespace mf
