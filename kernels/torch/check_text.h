// Numbers in the torch operators' error messages (kernels/torch/ops.cpp, the CUDA bindings) become
// text here, before TORCH_CHECK streams them.
// Why: a CUDA extension built with torch 2.11 and CUDA 13 on an H100 machine carried its own copy of
// the C++ library's stream code; streaming an integer into torch's message stream then looked up
// that copy's number formatter in torch's locale and crashed the process (SIGSEGV in
// ostream::_M_insert<long>) where a refusal was meant. Text (const char*, std::string) streams
// without the formatter, so every refusal stays one catchable error. The CPU operators built by the
// same torch on that machine crashed alike at their first refusal (a short weights buffer).
#pragma once
#include <string>

namespace mf {
inline std::string text(long long v) { return std::to_string(v); }
}  // namespace mf
