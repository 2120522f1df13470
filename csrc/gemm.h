// The batch-invariant bf16 GEMM: y = x W^T (+ b) for every bf16 linear, the logits head and the
// MoE experts (see gemm.cpp for the summation order it guarantees).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace phalanx {

// The instruction-set paths of `gemm` (gemm.cpp states each one's summation order). `kGemmAvx2`
// emulates the AVX512-BF16 dot product with float32 FMAs for CPUs without it: those two give the
// same bits. `kGemmAmx` runs on AMX tiles, whose hardware sums in an order of its own (gemm.cpp):
// batch-invariant as well, but not the same bits as the other two.
constexpr int64_t kGemmAvx2 = 1;
constexpr int64_t kGemmAvx512Bf16 = 2;
constexpr int64_t kGemmAmx = 3;
constexpr int64_t kAmxPairs = 16;  // K pairs per AMX tile step (a 16 x 64-byte weight tile)

// The pairs from one column block of a weight packed for path `isa` to the next: ceil(K / 2),
// rounded up to whole AMX steps (kAmxPairs) on the AMX path.
int64_t block_pairs(int64_t K, int64_t isa);

// W [N, K] bf16 -> [ceil(N / 16)][ceil(K / 2)][16][2]: for each block of 16 output columns, K in
// pairs, each pair's two weights adjacent (the AVX512-BF16 operand layout, which is also AMX's
// weight tile layout; zero padding past N and an odd K). On the AMX path the blocks lie
// block_pairs(K, isa) pairs apart, the padding between them zero (a view whose block stride says so).
at::Tensor pack_pairs(at::Tensor w, int64_t isa);

// Whether `packed` is pack_pairs(W, isa) of a W with K columns (its shape and strides).
bool is_packed_for(const at::Tensor& packed, int64_t K, int64_t isa);

// Whether this build has AMX-BF16 tiles and Linux granted this process their state.
bool amx_tiles_granted();

// This thread's AMX tile configuration (palette 1): tile t has rows[t] rows of 64 bytes, 0 unused.
// Only where amx_tiles_granted(); a no-op in a build without AMX. release_amx_tiles frees the state.
void configure_amx_tiles(const int (&rows)[8]);
void release_amx_tiles();

// The paths this build has (its -march), best first; empty below AVX2 + FMA.
std::vector<int64_t> gemm_isas();

// y [M, N] = x [M, K] W^T (+ bias [N]) with W packed by `pack_pairs` for path `isa`.
at::Tensor gemm(at::Tensor x, const at::Tensor& packed, int64_t N, const std::optional<at::Tensor>& bias,
                int64_t isa);

// Rows `ids` [T] (int64) of an embedding table -> [T, K]: a row-major [V, K] table (index_select), or
// the same table packed by `pack_pairs` (a tied model keeps only the logits head's packed copy; the
// lookup gathers each row's pairs back, the same values). V: the packed table's rows (ids must be
// below it; -1: every row of the padded blocks); ignored for a row-major table (its own rows).
at::Tensor embedding_rows(const at::Tensor& table, const at::Tensor& ids, int64_t K, int64_t V);

}  // namespace phalanx
