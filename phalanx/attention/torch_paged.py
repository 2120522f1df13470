"""Reference paged attention in pure PyTorch (the CPU path every fast path is tested against).

Owns: writing a layer's new K/V into its paged cache and attending over the cache for one flat,
mixed batch described by `AttentionMetadata`.
Does not own: the cache allocation (``worker.model_runner``) or the metadata (``attention.metadata``).

KV cache per layer: `kv[0]` keys, `kv[1]` values, each [num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phalanx.attention.metadata import AttentionMetadata


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
    flat_k = kv_cache[0].view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = kv_cache[1].view(num_blocks * block_size, num_kv_heads, head_dim)
    num_real = meta.slot_mapping.shape[0]  # padding tokens (lockstep) write nothing
    flat_k.index_copy_(0, meta.slot_mapping, k[:num_real])
    flat_v.index_copy_(0, meta.slot_mapping, v[:num_real])
    out = torch.empty_like(q)

    if meta.dec_token_idx is not None:
        assert meta.dec_block_table is not None and meta.dec_valid is not None
        bd, nbd = meta.dec_block_table.shape
        qd = q[meta.dec_token_idx].transpose(1, 2)  # [Bd, H, Qd, D]
        kd = kv_cache[0][meta.dec_block_table].view(bd, nbd * block_size, num_kv_heads, head_dim)
        vd = kv_cache[1][meta.dec_block_table].view(bd, nbd * block_size, num_kv_heads, head_dim)
        od = F.scaled_dot_product_attention(
            qd, kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=meta.dec_mask, scale=scale, enable_gqa=True
        )  # [Bd, H, Qd, D]
        od = od.transpose(1, 2)  # [Bd, Qd, H, D]
        out[meta.dec_token_idx[meta.dec_valid]] = od[meta.dec_valid]

    for seq in meta.prefills or ():
        qp = q[seq.start : seq.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        if seq.block_ids is None:
            # Fresh prompt: the keys are exactly this chunk's, plain causal attention.
            kp = k[seq.start : seq.end].transpose(0, 1).unsqueeze(0)
            vp = v[seq.start : seq.end].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
        else:
            seq_len = seq.num_computed + (seq.end - seq.start)
            kp = kv_cache[0][seq.block_ids].flatten(0, 1)[:seq_len].transpose(0, 1).unsqueeze(0)
            vp = kv_cache[1][seq.block_ids].flatten(0, 1)[:seq_len].transpose(0, 1).unsqueeze(0)
            q_pos = torch.arange(seq.num_computed, seq_len)
            mask = torch.arange(seq_len)[None, :] <= q_pos[:, None]  # [q, seq_len]
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=True)
        out[seq.start : seq.end] = op[0].transpose(0, 1)
    return out
