"""Whole jobs of 2–4 ranks in fresh processes, for tests that break their process group on purpose
(docs/reliability.md, cases R and H): a hang, a crash, a desync. The rank pool cannot serve them, since its group
would be reused after the break. Each job runs a test's script body after a preamble that joins a
gloo group with a short timeout; each rank ``report()``s what it saw to a JSON file. A hang is killed
whole at the deadline and counted, and the test checks that no process outlived the job. The body
may import the tests' helpers (``_models``): tests/ is on the job's ``PYTHONPATH`` under torchrun,
and forked ranks inherit this process's import path, where pytest put tests/.
"""

import json
import os
import runpy
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from _harness import forkserver

PREAMBLE = '''\
import datetime, json, os, sys, time, traceback
import torch, torch.distributed as dist
from torch import nn
import fsdp1
FSDP = fsdp1.FullyShardedDataParallel
torch.set_num_threads(1)
# Joined with a start-up timeout, then given the job's: on a loaded machine the ranks' interpreters
# finish importing seconds apart, which is not what a job's timeout is there to catch.
dist.init_process_group("gloo", init_method=os.environ.get("FSDP1_TEST_INIT", "env://"),
                        timeout=datetime.timedelta(seconds=max({pg_timeout_s}, 60)))
dist.barrier()
dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds={pg_timeout_s}))
rank = dist.get_rank()
T0 = time.monotonic()
def report(**fields):
    fields["elapsed"] = time.monotonic() - T0
    with open(os.path.join({out!r}, f"rank{{rank}}.json"), "w") as f:
        json.dump(fields, f)
def described(error):
    return {{"type": type(error).__name__, "message": str(error), "elapsed": time.monotonic() - T0,
            "exception": isinstance(error, Exception), "trace": traceback.format_exc()[-2500:]}}
def recorded_with_rank_0_failing_later(main):
    """``main`` under torchrun's ``@record``, rank 0 holding its error 1.1 s. torchrun names as root
    cause the failure with the earliest timestamp in whole seconds, a tie going to the lower rank;
    rank 0's error comes within milliseconds of the failing rank's exit, so without the hold a
    same-second tie would name rank 0."""
    from torch.distributed.elastic.multiprocessing.errors import record
    def holding():
        try:
            return main()
        except Exception:
            if rank == 0:
                time.sleep(1.1)
            raise
    return record(holding)
'''


@dataclass
class Job:
    returncodes: List[int]
    reports: Dict[int, dict]
    output: str
    wall_s: float
    timed_out: bool
    leftover: bool = field(default=False)


def run_job(tmp_path: Path, body: str, nproc: int = 2, torchrun: bool = True, timeout_s: float = 60,
            pg_timeout_s: float = 2, torchrun_args: tuple = (), env: Optional[Dict[str, str]] = None,
            fork: bool = True) -> Job:
    """Run ``body`` on ``nproc`` ranks, under torchrun or (``torchrun=False``) as plain processes with
    no agent to stop the others when one fails. Plain processes are forked from a server that
    imported torch and fsdp1 once (5 s a job saved), or with ``fork=False`` are fresh interpreters
    (for a test of the interpreter's own exit, which a forked process never runs); ``env`` is set in
    them before the script runs."""
    out = tmp_path / f"job-{time.monotonic_ns()}"
    out.mkdir()
    script = out / "job.py"
    script.write_text(PREAMBLE.format(out=str(out), pg_timeout_s=pg_timeout_s)
                      + textwrap.dedent(body))
    if not torchrun and fork:
        return _forked(script, out, nproc, timeout_s, env or {})
    start = time.monotonic()
    pythonpath = os.pathsep.join([str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])])
    base_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath, **(env or {})}
    if not torchrun:
        return _interpreters(script, out, nproc, timeout_s, base_env)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               *torchrun_args, str(script)]
    proc = subprocess.Popen(command, env=base_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    timed_out = False
    try:
        output = proc.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:  # a hang: the whole session goes
        timed_out = True
        _kill_session(proc.pid)
        output = proc.communicate()[0]
    wall = time.monotonic() - start
    leftover = _session_alive(proc.pid)
    if leftover:
        _kill_session(proc.pid)
    return Job([proc.returncode], _reports(out), output, wall, timed_out, leftover)


def _reports(out: Path) -> Dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


def _forked(script: Path, out: Path, nproc: int, timeout_s: float, env: Dict[str, str]) -> Job:
    server = forkserver()
    start = time.monotonic()
    procs = [server.Process(target=_run_rank, args=(str(script), rank, nproc, str(out), env)) for rank in range(nproc)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=max(0.0, timeout_s - (time.monotonic() - start)))
    timed_out = any(proc.is_alive() for proc in procs)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    output = "\n".join(Path(out, f"output{rank}.txt").read_text() for rank in range(nproc))
    return Job([proc.exitcode for proc in procs], _reports(out), output, time.monotonic() - start, timed_out)


def _interpreters(script: Path, out: Path, nproc: int, timeout_s: float, env: Dict[str, str]) -> Job:
    """The ranks as fresh interpreters of their own (``python job.py``), joined through a file store,
    each in a session of its own that a hang loses whole."""
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(script)], env={
        **env, "RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
        "FSDP1_TEST_INIT": f"file://{out}/store?rank={rank}&world_size={nproc}"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True) for rank in range(nproc)]
    outputs, timed_out = [], False
    for proc in procs:
        try:
            wait = None if timed_out else max(0.0, start + timeout_s - time.monotonic())
            outputs.append(proc.communicate(timeout=wait)[0])
        except subprocess.TimeoutExpired:
            timed_out = True
            for each in procs:
                _kill_session(each.pid)
            outputs.append(proc.communicate()[0])
    leftover = any(_session_alive(proc.pid) for proc in procs)
    for proc in procs:
        _kill_session(proc.pid)
    return Job([proc.returncode for proc in procs], _reports(out), "\n".join(outputs), time.monotonic() - start,
               timed_out, leftover)


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _run_rank(script: str, rank: int, nproc: int, out: str, env: Dict[str, str]) -> None:
    """One rank of a plain job, in a forked process: its output to a file, then the script."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
                      FSDP1_TEST_INIT=f"file://{out}/store?rank={rank}&world_size={nproc}", **env)
    log = os.open(os.path.join(out, f"output{rank}.txt"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    runpy.run_path(script, run_name="__main__")


def _session_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def failed(job: Job) -> Optional[str]:
    """What went wrong with the job as a job (a hang or a process left behind), for an assert message."""
    if job.timed_out:
        return f"the job hung (killed after {job.wall_s:.0f} s):\n{job.output[-3000:]}"
    if job.leftover:
        return "a process outlived the job"
    return None
