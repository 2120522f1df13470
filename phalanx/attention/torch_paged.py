"""Reference paged attention in pure PyTorch (the CPU path every fast path is tested against).

Owns: writing a layer's new K/V into its paged cache and attending over the cache for one flat,
mixed batch described by `AttentionMetadata`.
Does not own: the cache allocation (``worker.model_runner``) or the metadata (``attention.metadata``).

KV cache per layer: `kv[0]` keys, `kv[1]` values, each [num_kv_heads, num_blocks, block_size, head_dim]
(head-major: gathering a batch's blocks yields [kvh, R, L, D], which the attention matmuls consume as
they are; a block-major layout made every decode step transpose — copy — the gathered K and V).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phalanx.attention.metadata import AttentionMetadata
from phalanx.ops import cpu as cpu_ops


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """Shape of one layer's cache (keys and values)."""
    return (2, num_kv_heads, num_blocks, block_size, head_dim)


def cache_block_size(kv_cache: torch.Tensor) -> int:
    return kv_cache.shape[3]


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_kv_heads, num_blocks, block_size, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    kernel = attention_kernel(q.dtype, meta, q.device.type)
    if kernel is not None:  # one call for keys and values
        kernel.cache_write(kv_cache, k, v, meta.slot_mapping)
    else:
        num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape[1:]
        flat_k = kv_cache[0].view(num_kv_heads, num_blocks * block_size, head_dim)
        flat_v = kv_cache[1].view(num_kv_heads, num_blocks * block_size, head_dim)
        num_real = meta.slot_mapping.shape[0]  # padding tokens (lockstep) write nothing
        flat_k.index_copy_(1, meta.slot_mapping, k[:num_real].transpose(0, 1))
        flat_v.index_copy_(1, meta.slot_mapping, v[:num_real].transpose(0, 1))
    if meta.uniform_decode_len:  # the flat batch is the decode group's [R, Q] grid, rows in order
        t, h, d = q.shape
        grid = q.view(t // meta.uniform_decode_len, meta.uniform_decode_len, h, d)
        return _decode_group(grid, kv_cache, meta, scale).view(t, h, d)
    out = torch.empty_like(q)

    if meta.dec_token_idx is not None:
        assert meta.dec_valid is not None
        od = _decode_group(q[meta.dec_token_idx], kv_cache, meta, scale)
        out[meta.dec_token_idx[meta.dec_valid]] = od[meta.dec_valid]

    for seq in meta.prefills or ():
        if kernel is not None and seq.block_ids is not None:
            # The decode kernel takes any query count: keys and values from the paged cache (this
            # chunk's already written), causal through `visible`; each query's result is the one it
            # would get decoding (SDPA's flash kernel, not batch-invariant: 2.5-3.7x slower on
            # 16-256-token prompts on an AVX512-BF16 CPU; on an AMX one 1.3-1.7x the AMX task's time
            # on 512-1,930-token prompts).
            assert seq.visible is not None
            grid = q[seq.start : seq.end].unsqueeze(0)  # [1, q, H, D]
            out[seq.start : seq.end] = cpu_ops.decode_attention(
                kernel, grid, kv_cache, seq.block_ids, seq.visible, scale, attention_isa(meta))[0]
            continue
        qp = q[seq.start : seq.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if seq.num_computed == 0:
            # Fresh prompt: the keys are exactly this chunk's, plain causal attention.
            kp = k[seq.start : seq.end].transpose(0, 1).unsqueeze(0)
            vp = v[seq.start : seq.end].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
        else:
            seq_len = seq.num_computed + (seq.end - seq.start)
            assert seq.block_ids is not None
            kp = _gather(kv_cache[0], seq.block_ids, meta.memo.gather_index)[:, 0, :seq_len].unsqueeze(0)  # [1, kvh, L, D]
            vp = _gather(kv_cache[1], seq.block_ids, meta.memo.gather_index)[:, 0, :seq_len].unsqueeze(0)
            q_pos = torch.arange(seq.num_computed, seq_len)
            mask = torch.arange(seq_len)[None, :] <= q_pos[:, None]  # [q, seq_len]
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=True)
        out[seq.start : seq.end] = op[0].transpose(0, 1)
    return out


def _decode_group(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The decode group's [Bd, Qd, H, D] query grid -> its attention output: the fused C++ kernel
    when available (``ops.cpu``), else the reference grouped matmuls."""
    assert meta.dec_block_table is not None and meta.dec_visible is not None
    kernel = attention_kernel(q.dtype, meta, q.device.type)
    if kernel is not None:
        return cpu_ops.decode_attention(kernel, q, kv_cache, meta.dec_block_table, meta.dec_visible, scale,
                                        attention_isa(meta))
    mask = meta.memo.dec_mask
    if mask is None:  # [Bd, Qd, 1, L], True = masked out (a key after the query's position)
        key_pos = torch.arange(meta.dec_block_table.shape[1] * cache_block_size(kv_cache))
        mask = meta.memo.dec_mask = (key_pos[None, None, :] >= meta.dec_visible[:, :, None])[:, :, None, :]
    return _decode_group_attention(q, kv_cache, meta.dec_block_table, mask, scale, meta.memo.gather_index)


def attention_kernel(dtype: torch.dtype, meta: AttentionMetadata, device: str = "cpu"):  # -> module or None
    """The C++ kernels when they serve this forward's attention (the backend allows them and the
    dtype is theirs), looked up once per forward (memoised on `meta`)."""
    kernels = meta.memo.attention_kernels
    if (dtype, device) not in kernels:
        kernels[dtype, device] = cpu_ops.kernel_for(dtype) if device == "cpu" else None
    return kernels[dtype, device]


def attention_isa(meta: AttentionMetadata) -> int:
    """The GEMM path (``ops.cpu.gemm_isa``) the kernel's bf16 attention follows in this forward, as
    the linears do (3: AMX tiles; else the register-tiled task), looked up once per forward."""
    if meta.memo.attention_isa is None:
        meta.memo.attention_isa = cpu_ops.gemm_isa()
    return meta.memo.attention_isa


def _gather(cache: torch.Tensor, block_ids: torch.Tensor,
            memo: dict[tuple[torch.Tensor, int, int], torch.Tensor] | None = None) -> torch.Tensor:
    """[kvh, num_blocks, B, d] gathered at block_ids (any shape [...]) -> [kvh, ..., * B, d] flattened
    over the last block dimension, contiguous. One index_select over dim 0 of the 2-D [kvh *
    num_blocks, B * d] view: one block per row (~2.7x faster than selecting along dim 1 of the 4-D
    cache, ~2x faster than over dim 0 of a 3-D view, and ~10x faster than advanced indexing); the
    index is the same for every layer of a forward, so it is memoised in `memo`."""
    kvh, num_blocks, block_size, d = cache.shape
    key = (block_ids, kvh, num_blocks)  # a tensor key is its identity: this forward's table
    index = memo.get(key) if memo is not None else None
    if index is None:
        index = (torch.arange(kvh)[:, None] * num_blocks + block_ids.reshape(1, -1)).reshape(-1)
        if memo is not None:
            memo[key] = index
    rows = torch.index_select(cache.view(kvh * num_blocks, block_size * d), 0, index)  # [kvh * n, B * d]
    return rows.view(kvh, *block_ids.shape[:-1], -1, d)


def _decode_group_attention(
    q: torch.Tensor,  # [Bd, Qd, H, D] padded query grid
    kv_cache: torch.Tensor,  # [2, kvh, num_blocks, block_size, D]
    block_table: torch.Tensor,  # [Bd, NB]
    masked: torch.Tensor,  # [Bd, Qd, 1, NB * block_size] bool, True = masked out
    scale: float,
    memo: dict[tuple[torch.Tensor, int, int], torch.Tensor],  # ForwardMemo.gather_index
) -> torch.Tensor:  # [Bd, Qd, H, D]
    """Attention for short queries as grouped matmuls: the query heads sharing a KV head are one
    batch row, so K/V are never repeated; scores and softmax in float32. (On CPU this is several
    times faster than SDPA's kernel for 1-16 query tokens, which is why decode does not use it.)
    The gathered K/V are [kvh, Bd, L, D] and used in place: only the small query and output grids
    are permuted."""
    bd, qd, h, d = q.shape
    kvh = kv_cache.shape[1]
    g = h // kvh
    k = _gather(kv_cache[0], block_table, memo)  # [kvh, Bd, L, D]
    v = _gather(kv_cache[1], block_table, memo)
    # heads [kv0: h0..h(g-1), kv1: ...] -> [kvh, Bd, Qd * g, D]
    qg = q.view(bd, qd, kvh, g, d).permute(2, 0, 1, 3, 4).reshape(kvh, bd, qd * g, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [kvh, Bd, Qd * g, L]
    scores = scores.view(kvh, bd, qd, g, -1).masked_fill(masked, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(kvh, bd, qd * g, -1)
    out = torch.matmul(probs, v)  # [kvh, Bd, Qd * g, D]
    return out.view(kvh, bd, qd, g, d).permute(1, 2, 0, 3, 4).reshape(bd, qd, h, d)
