"""The pool of fixed-size KV-cache blocks: reference counts, free queue, prefix-cache index.

Owns: which block ids exist, who holds them (ref counts), the order in which free blocks are
reused (least recently freed first, so cached prefixes survive as long as possible), and the map
from a full block's chained hash to the block that holds it.
Does not own: which request holds which blocks (``kv_cache_manager``), or the KV tensors.

Invariants (tested by property tests):
* a block is in the free queue iff its ref_cnt == 0;
* `cached` maps a hash to a block carrying that hash; a block with a hash stays there until it is
  evicted for reuse, unless a block with the same hash and drafter KV took its place (below);
* free blocks that still carry a hash can be revived by a prefix hit (`touch`).

Drafter KV. With a model-based drafter (EAGLE, a draft model) a block also holds the drafter's KV
for its positions, or not: a request that never drafts (opted out) never feeds the drafter, and a
waiting request's catch-up has not reached it yet. `drafter_kv` says which; a request that drafts
takes prefix hits only up to the first block without it, and a block whose catch-up arrives is
marked then. Of two blocks with the same hash, the one with drafter KV is the one `cached` serves.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    drafter_kv: bool = True  # its drafter KV is complete (meaningful while block_hash is set)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free blocks in eviction order: first = next to reuse. OrderedDict gives O(1) removal
        # from the middle when a prefix hit revives a free cached block.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, n: int) -> list[KVBlock]:
        """Take n free blocks (evicting their cached contents). Caller checked availability."""
        if n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            assert block.ref_cnt == 0
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.drafter_kv = True
            block.ref_cnt = 1
            out.append(block)
        return out

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks, reviving them from the free queue if needed."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference on each block. Pass a request's blocks tail-first so that the
        tail of a prefix is evicted before its head (heads are shared more often)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def cache_block(self, block: KVBlock, block_hash: int, drafter_kv: bool = True) -> None:
        """Register a full, computed block under its chained hash (of two blocks with one hash the
        first wins, unless only the second holds drafter KV), or mark a registered block's drafter
        KV complete (`drafter_kv` True for a block registered without it)."""
        if not self.enable_caching:
            return
        if block.block_hash is None:
            block.block_hash = block_hash
            block.drafter_kv = drafter_kv
        elif drafter_kv and not block.drafter_kv:
            block.drafter_kv = True
        else:
            return
        held = self.cached.get(block_hash)
        if held is None or (block.drafter_kv and not held.drafter_kv):
            self.cached[block_hash] = block
