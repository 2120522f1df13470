"""Maps requests to KV blocks: allocation, prefix-cache hits, hashing of computed blocks, freeing.

Owns: req_id -> list of blocks, req_id -> chained block hashes.
Does not own: scheduling policy (``scheduler``), the pool's free queue (``block_pool``).

Chained hashes: block i's hash covers (hash of block i-1, tokens of block i), so equal hashes mean
equal whole prefixes. Only blocks fully covered by *computed* tokens are hashed and shared; the
last token of a request is never served from the cache (something must run to produce logits).
"""

from __future__ import annotations

from phalanx.core.block_pool import BlockPool, KVBlock
from phalanx.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_hashes: dict[str, list[int]] = {}
        # Prefix-cache statistics (in tokens) for metrics.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- hashing -------------------------------------------------------------------------
    def _block_hashes(self, req: Request, num_full_blocks: int) -> list[int]:
        hashes = self.req_hashes.setdefault(req.req_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else 0
            tokens = tuple(req.token_at(j) for j in range(i * bs, (i + 1) * bs))
            hashes.append(hash((parent, tokens)))
        return hashes

    # ---- prefix hits ---------------------------------------------------------------------
    def get_computed_blocks(self, req: Request, need_drafter_kv: bool = False) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of `req` in whole blocks, leaving at least one token to compute;
        `need_drafter_kv` (a request that drafts): only blocks whose drafter KV is complete."""
        if not self.enable_caching or req.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need every prompt position computed, so they never read the cache.
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(req, max_blocks)
        hit: list[KVBlock] = []
        for h in hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None or (need_drafter_kv and not block.drafter_kv):
                break
            hit.append(block)
        return hit, len(hit) * self.block_size

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
        num_lookahead: int = 0,
    ) -> list[int] | None:
        """Make the request's blocks cover num_computed (+ hit) + num_new tokens, plus
        `num_lookahead` slots past them where a drafter writes its speculative KV.

        Returns the newly added block ids (prefix hits first), or None (and changes nothing) when
        the pool cannot supply them.
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_blocks.setdefault(req.req_id, [])
        num_computed = req.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = num_computed + num_new_tokens + num_lookahead
        needed = cdiv(total, self.block_size) - len(blocks) - len(new_computed_blocks)
        # Reviving free cached blocks for a hit also consumes free-queue entries.
        revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(needed, 0) + revived > self.pool.num_free_blocks:
            return None
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        fresh = self.pool.allocate(needed) if needed > 0 else []
        blocks.extend(fresh)
        return [b.block_id for b in new_computed_blocks] + [b.block_id for b in fresh]

    def cache_computed_blocks(self, req: Request, drafter_upto: int | None = None) -> None:
        """Register every block fully covered by computed (verified) tokens in the prefix cache;
        `drafter_upto`: a drafter's KV is complete only below this position (None: everywhere, or
        no drafter KV to speak of), the blocks past it are registered without drafter KV and
        marked when it gets there."""
        if not self.enable_caching:
            return
        end = min(req.num_computed_tokens, req.num_tokens)
        blocks = self.req_blocks.get(req.req_id, [])
        num_full = min(end // self.block_size, len(blocks))
        with_drafter = num_full if drafter_upto is None else min(num_full, drafter_upto // self.block_size)
        hashes = self._block_hashes(req, num_full)
        for i in range(num_full):
            block = blocks[i]
            if block.block_hash is None or (i < with_drafter and not block.drafter_kv):
                self.pool.cache_block(block, hashes[i], i < with_drafter)

    def free(self, req: Request, forget_hashes: bool = True) -> None:
        """Return the request's blocks (tail first). Preemption keeps the hashes for re-admission."""
        blocks = self.req_blocks.pop(req.req_id, [])
        self.pool.free(list(reversed(blocks)))
        if forget_hashes:
            self.req_hashes.pop(req.req_id, None)

    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(req_id, [])]

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()
