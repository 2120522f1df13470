"""The data-parallel process group: the only place phalanx issues torch.distributed collectives.

Owns: creating the group (gloo on CPU, NCCL on CUDA) with a finite timeout, the lockstep vote,
the collectives of expert parallelism, turning a timeout or a dead peer into `DPError` naming the
rank, the call site and the step, and the debug mode that checks every collective's fingerprint
(call site, op, shape) across ranks before issuing it.
Does not own: what is voted on (``distributed.vote``) or the MoE math (``layers.moe``).

Every collective goes through `_collective`, so the fingerprint check cannot be bypassed. A check
is itself a collective of a fixed shape, so a mismatch is reported instead of hanging or aborting
inside gloo (gloo aborts the process on mismatched shapes, which is why rule 2 matters).
"""

from __future__ import annotations

import contextlib
import datetime
import enum
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

_SITE_LEN = 96


class Op(enum.IntEnum):
    ALL_GATHER = 1
    ALL_REDUCE = 2


class DPError(RuntimeError):
    """A collective failed (timeout, dead peer) or ranks diverged; the message names rank and step."""


class CollectiveMismatch(DPError):
    pass


def _encode(site: str, op: Op, shape: tuple[int, ...]) -> torch.Tensor:
    fp = torch.zeros(2 + 4 + _SITE_LEN, dtype=torch.int64)
    fp[0], fp[1] = int(op), len(shape)
    for i, d in enumerate(shape[:4]):
        fp[2 + i] = d
    raw = site.encode()[:_SITE_LEN]
    fp[6 : 6 + len(raw)] = torch.tensor(list(raw), dtype=torch.int64)
    return fp


def _decode(fp: torch.Tensor) -> str:
    op = Op(int(fp[0])).name.lower() if int(fp[0]) in Op._value2member_map_ else f"op{int(fp[0])}"
    shape = tuple(int(d) for d in fp[2 : 2 + int(fp[1])])
    site = bytes(int(c) for c in fp[6:] if int(c) != 0).decode(errors="replace")
    return f"{site!r} ({op} {list(shape)})"


class DPGroup:
    def __init__(
        self,
        rank: int,
        size: int,
        init_method: str,
        timeout_s: float,
        check_collectives: bool = False,
        backend: str = "gloo",
    ) -> None:
        self.rank = rank
        self.size = size
        self.timeout_s = timeout_s
        self.check_collectives = check_collectives
        self.step = 0
        self._context = "engine"
        self.agreed_tokens: int | None = None
        try:
            dist.init_process_group(
                backend,
                init_method=init_method,
                rank=rank,
                world_size=size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        except Exception as e:
            raise DPError(f"rank {rank}: could not join the data-parallel group at {init_method}: {e}") from e

    def close(self) -> None:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()

    @contextlib.contextmanager
    def context(self, label: str, agreed_tokens: int | None = None) -> Iterator[None]:
        """Label collectives issued inside (e.g. "target forward", "drafter pass 2") and record the
        batch size the vote agreed on for this forward (None: no forward may exchange tokens)."""
        old = (self._context, self.agreed_tokens)
        self._context, self.agreed_tokens = label, agreed_tokens
        try:
            yield
        finally:
            self._context, self.agreed_tokens = old

    def check_agreed(self, num_tokens: int, site: str) -> None:
        """Rule 2: a token exchange must run at the voted size; never guess one locally."""
        if self.agreed_tokens != num_tokens:
            raise DPError(
                f"rank {self.rank}: {self._context}: {site} got {num_tokens} tokens but the vote agreed on "
                f"{self.agreed_tokens} (a forward ran without a voted plan?)"
            )

    # ---- collectives -------------------------------------------------------------------
    def _collective(self, site: str, op: Op, tensor: torch.Tensor, run: Callable[[], None]) -> None:
        full_site = f"{self._context}: {site}"
        try:
            if self.check_collectives:
                self._check(full_site, op, tuple(tensor.shape))
            run()
        except CollectiveMismatch:
            raise
        except Exception as e:
            raise DPError(
                f"rank {self.rank}: collective {full_site!r} failed at lockstep step {self.step} "
                f"(timeout {self.timeout_s:g}s or a dead peer): {e}"
            ) from e

    def _check(self, site: str, op: Op, shape: tuple[int, ...]) -> None:
        fp = _encode(site, op, shape)
        gathered = [torch.empty_like(fp) for _ in range(self.size)]
        dist.all_gather(gathered, fp)
        for r, other in enumerate(gathered):
            if not torch.equal(other, fp):
                raise CollectiveMismatch(
                    f"collective mismatch at lockstep step {self.step}: rank {self.rank} is at "
                    f"{_decode(fp)} but rank {r} is at {_decode(other)}"
                )

    def all_gather(self, tensor: torch.Tensor, site: str) -> torch.Tensor:
        """[N, ...] on every rank -> [size * N, ...] in rank order."""
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        self._collective(site, Op.ALL_GATHER, tensor, lambda: dist.all_gather(out, tensor))
        return torch.cat(out, dim=0)

    def all_reduce_sum(self, tensor: torch.Tensor, site: str) -> torch.Tensor:
        tensor = tensor.contiguous()
        self._collective(site, Op.ALL_REDUCE, tensor, lambda: dist.all_reduce(tensor))
        return tensor

    def vote(self, row: torch.Tensor) -> torch.Tensor:
        """The one agreement collective of a loop iteration: [F] -> [size, F]."""
        with self.context("engine loop"):
            table = self.all_gather(row.unsqueeze(0), "vote")
        return table
