// bf16 linears on the CPU's own dot-product instructions (see gemm.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace phalanx {

// W [N, K] bf16 -> [ceil(N / 16)][ceil(K / 2)][16][2]: AVX512-BF16 pairs of 16 output columns.
at::Tensor pack_pairs(at::Tensor w);
// Whether this build has the AVX512-BF16 kernel behind pair_linear.
bool pair_linear_supported();
// y = x W^T for x [M, K] bf16 (contiguous) and W packed by pack_pairs; N = W's rows.
at::Tensor pair_linear(at::Tensor x, at::Tensor packed, int64_t N);

}  // namespace phalanx
