// The Python module: every operation ops.cpu calls, registered under its C++ name.
#include <torch/python.h>

#include "gemm.h"
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace phalanx;
  m.def("decode_attention", torch::wrap_pybind_function(decode_attention), "decode_attention");
  m.def("decode_attention_f32", torch::wrap_pybind_function(decode_attention_f32), "decode_attention_f32");
  m.def("rms_norm", torch::wrap_pybind_function(rms_norm), "rms_norm");
  m.def("add_rms_norm", torch::wrap_pybind_function(add_rms_norm), "add_rms_norm");
  m.def("rotary", torch::wrap_pybind_function(rotary), "rotary");
  m.def("silu_mul", torch::wrap_pybind_function(silu_mul), "silu_mul");
  m.def("argmax_rows", torch::wrap_pybind_function(argmax_rows), "argmax_rows");
  m.def("cache_write", torch::wrap_pybind_function(cache_write), "cache_write");
  m.def("pack_pairs", torch::wrap_pybind_function(pack_pairs), "pack_pairs");
  m.def("gemm", torch::wrap_pybind_function(gemm), "gemm");
  m.def("embedding_rows", torch::wrap_pybind_function(embedding_rows), "embedding_rows");
  m.def("gemm_isas", torch::wrap_pybind_function(gemm_isas), "gemm_isas");
  m.def("fused_layer", torch::wrap_pybind_function(fused_layer), "fused_layer");
  m.def("eagle_chain", torch::wrap_pybind_function(eagle_chain), "eagle_chain");
  m.def("model_chain", torch::wrap_pybind_function(model_chain), "model_chain");
}
