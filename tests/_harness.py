"""A persistent pool of gloo ranks for multi-rank tests, and the forkserver every process the tests
start without a launcher is forked from.

A spawned rank imports torch, fsdp1, torch's compiler and the test's own module (about 5 s of CPU, 20 s
for a pool of eight on two cores, and a run of the suite starts 18 pools, 68 ranks); a rank forked
from the forkserver, which imported them once, starts in a fraction of a second; a test on a warm
pool costs milliseconds.

Test bodies are module-level functions, run on every rank; their return values come back to pytest
as a list indexed by rank.
The first rank to fail (exception, death or timeout) kills the whole pool, since its peers may be
blocked in a collective it never entered, and the test raises that rank's traceback; the next test
starts a fresh pool, so no group is reused after a possible desynchronisation.
"""

import os
import queue
import socket
import time
import traceback
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler  # torch.multiprocessing registers its tensor reductions
from typing import Any, Callable, Dict, List

import torch.multiprocessing as mp

PRELOADED = ["torch", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.tensor",
             "torch.distributed.pipelining", "transformers.models.gpt2.modeling_gpt2",
             "transformers.models.llama.modeling_llama", "fsdp1", "_models", "_fuzz", "_fuzz_stack"]
"""What the forkserver imports before it forks: what nearly every rank imports (torch._dynamo with the
first optimizer step, DCP and DTensor with fsdp1's state dicts, the pipeline schedules and the
Transformers models the tests run most). Nothing that starts a thread: a fork keeps only its caller's."""
RANK_TIMEOUT_S = 60  # gloo's own timeout: a backstop behind the pool's per-test deadline
MAX_GROUPS = 24
"""A pool whose ranks hold more process groups than this (the meshes and subgroups its tests made,
which torch keeps for the life of the process) is replaced by a fresh one after the test: each gloo
group keeps a thread that wakes about a hundred times a second, and the hundreds a session made
slowed its last tests several times over. Destroying them instead breaks torch's meshes, which keep
their groups' names."""


class RankFailure(AssertionError):
    pass


def forkserver() -> Any:
    """The one forkserver context of this process (multiprocessing keeps a single server, so its
    preload is set here, before anything starts it)."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)
    return context


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=RANK_TIMEOUT_S),
    )
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            result = fn(*args)
            ForkingPickler.dumps(result)  # unpicklable (a tensor needing grad): fail here, not in the queue's thread
            results.put((rank, True, (result, len(dist.distributed_c10d._world.pg_map))))
        except BaseException:  # noqa: BLE001 - every failure goes back to pytest
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """``world_size`` worker processes joined in one gloo group, reused across tests."""

    def __init__(self, world_size: int) -> None:
        ctx = forkserver()
        self.world_size = world_size
        self.groups = 0  # the most process groups a rank of the pool holds
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        port = _free_port()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, self._tasks[r], self._results), daemon=True)
            for r in range(world_size)
        ]
        for proc in self._procs:
            proc.start()

    def run(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> List[Any]:
        for task_queue in self._tasks:
            task_queue.put((fn, args))
        results: Dict[int, Any] = {}
        waited = 0.0
        while len(results) < self.world_size:
            try:
                rank, ok, payload = self._results.get(timeout=0.25)
            except queue.Empty:
                waited += 0.25
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in results]
                if dead:
                    raise RankFailure(f"rank {dead[0]} died (exit code {self._procs[dead[0]].exitcode}) in {fn.__name__}")
                if waited > timeout_s:
                    missing = sorted(set(range(self.world_size)) - set(results))
                    raise RankFailure(f"ranks {missing} did not finish {fn.__name__} within {timeout_s:.0f} s")
                continue
            if not ok:
                raise RankFailure(f"rank {rank} of {self.world_size} failed in {fn.__name__}:\n{payload}")
            results[rank], groups = payload
            self.groups = max(self.groups, groups)
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        self.ask_to_stop()
        self.end_by(time.monotonic() + 2)

    def ask_to_stop(self) -> None:
        for task_queue in self._tasks:
            try:
                task_queue.put(None)
            except (OSError, ValueError):
                pass

    def end_by(self, deadline: float) -> None:
        """Let the workers leave their group until ``deadline`` (one for them all: a worker whose
        peers left first may wait on them), then kill those still there."""
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join()


_pools: Dict[int, RankPool] = {}


def run_on_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 180) -> List[Any]:
    """Run ``fn(*args)`` on every rank of a ``world_size`` gloo group; return each rank's result."""
    pool = _pools.get(world_size)
    if pool is None:
        pool = _pools[world_size] = RankPool(world_size)
    try:
        results = pool.run(fn, args, timeout_s)
    except BaseException:
        _pools.pop(world_size)
        for proc in pool._procs:
            proc.kill()
        pool.close()
        raise
    if pool.groups > MAX_GROUPS:
        _pools.pop(world_size).close()
    return results


def close_pools() -> None:
    pools = list(_pools.values())
    _pools.clear()
    for pool in pools:
        pool.ask_to_stop()
    deadline = time.monotonic() + 2
    for pool in pools:
        pool.end_by(deadline)
