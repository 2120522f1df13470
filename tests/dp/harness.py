"""Multi-process lockstep harness: N engine cores on N processes joined by a gloo group, each fed
its own request schedule, stepping `step_lockstep` until the vote says nobody has work.

Used by the DP tests (no ZMQ, no HTTP: the lockstep protocol alone). Every run has a wall-clock
bound; a rank that hangs fails the test instead of hanging it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
from dataclasses import dataclass, field
from typing import Any

from phalanx.net import free_port


@dataclass
class RankJob:
    # (arrival iteration, request id, prompt token ids, SamplingParams kwargs, abort at iteration or -1)
    requests: list[tuple[int, str, list[int], dict[str, Any], int]] = field(default_factory=list)
    skip_drafter_for_test: bool = False


def process_alive(pid: int) -> bool:
    """Whether `pid` runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[-1][:1] != "Z"


def _rank_main(rank: int, size: int, port: int, llm_kwargs: dict, par_kwargs: dict, job: RankJob,
               results: Any, environ: dict[str, str]) -> None:
    # The fork server's environment is the one of its own start: take the caller's, as spawn would.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import dataclasses

    import torch

    torch.set_num_threads(1)
    from phalanx.config import ParallelConfig
    from phalanx.distributed.group import DPGroup
    from phalanx.engine.args import EngineArgs
    from phalanx.engine.engine_core import EngineCore, EngineCoreRequest
    from phalanx.sampling_params import SamplingParams

    group = None
    try:
        cfg = EngineArgs(**llm_kwargs).create_engine_config()
        cfg = dataclasses.replace(
            cfg, parallel=ParallelConfig(data_parallel_size=size, data_parallel_rank=rank, **par_kwargs)
        )
        group = DPGroup(rank, size, f"tcp://127.0.0.1:{port}", cfg.parallel.dp_timeout_s,
                        cfg.parallel.check_collectives)
        core = EngineCore(cfg, group)
        if job.skip_drafter_for_test:  # the seed's bug: this rank skips the drafter without the vote
            core.runner.proposer.propose = lambda batch: [[] for _ in batch.req_ids]
        pending = sorted(job.requests, key=lambda r: r[0])
        aborts = {r[1]: r[4] for r in job.requests if r[4] >= 0}
        tokens: dict[str, list[int]] = {}
        finish: dict[str, str] = {}
        it = 0
        dummy_steps = 0
        while True:
            while pending and pending[0][0] <= it:
                _, rid, prompt, params, _ = pending.pop(0)
                core.add_request(EngineCoreRequest(rid, prompt, SamplingParams(**params)))
                tokens[rid] = []
            for rid, at in list(aborts.items()):
                if at <= it:
                    core.abort_requests([rid])
                    finish.setdefault(rid, "abort")
                    del aborts[rid]
            had_work = core.has_unfinished_requests()
            outputs, plan = core.step_lockstep(expecting_work=bool(pending))
            if plan.run_forward and not had_work:
                dummy_steps += 1
            for o in outputs:
                tokens[o.req_id].extend(o.new_token_ids)
                if o.finish_reason:
                    finish[o.req_id] = o.finish_reason
            it += 1
            if not plan.any_work:
                break
        results.put((rank, "ok", {"tokens": tokens, "finish": finish, "iterations": it,
                                  "dummy_steps": dummy_steps, "free_blocks": core.scheduler.kv.num_free_blocks,
                                  "num_blocks": core.runner.num_blocks, "metrics": core.stats().__dict__}))
    except Exception as e:  # noqa: BLE001 - report every failure to the parent
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if group is not None:
            group.close()


def fork_context() -> Any:
    """Processes fork from one server process that imported torch once (an import is ~4 s of a
    2-core CPU, paid per process with spawn); it has run no op, so no thread pool is forked. The
    server's environment is its own start's: pass a child the caller's if it matters."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    return ctx


def run_ranks(size: int, llm_kwargs: dict, par_kwargs: dict, jobs: list[RankJob], timeout_s: float = 120.0
              ) -> dict[int, tuple[str, Any]]:
    """Run `size` lockstep ranks; returns rank -> ("ok", result) | ("error", message) | ("died", exit
    code) | ("hung", "")."""
    ctx = fork_context()  # phalanx itself is imported in each rank, after the caller's environment is in place
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main,
                         args=(r, size, port, llm_kwargs, par_kwargs, jobs[r], results, dict(os.environ)))
             for r in range(size)]
    for p in procs:
        p.start()
    out: dict[int, tuple[str, Any]] = {}
    import time

    deadline = time.monotonic() + timeout_s
    while len(out) < size and time.monotonic() < deadline:
        try:
            rank, status, payload = results.get(timeout=0.5)
            out[rank] = (status, payload)
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
    hung = {r for r, p in enumerate(procs) if p.is_alive() and r not in out}
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    for r, p in enumerate(procs):
        if r not in out:  # no report: still running at the deadline, or died (e.g. gloo abort)
            out[r] = ("hung", "") if r in hung else ("died", f"exit code {p.exitcode}")
    return out
