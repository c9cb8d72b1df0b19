"""Whole jobs of 2–4 ranks in fresh processes, for tests that break their process group on purpose
(reliability.md §3.2–3.3): a hang, a crash, a desync. The rank pool cannot serve them, since its group
would be reused after the break. Each job runs a test's script body after a preamble that joins a
gloo group with a short timeout; each rank ``report()``s what it saw to a JSON file. The job runs in
a session of its own, so a hang is killed whole and counted, and the test can check that no process
outlived it.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

PREAMBLE = '''\
import datetime, json, os, sys, time, traceback
import torch, torch.distributed as dist
from torch import nn
sys.path.insert(0, {tests!r})
import fsdp1
FSDP = fsdp1.FullyShardedDataParallel
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds={pg_timeout_s}))
rank = dist.get_rank()
T0 = time.monotonic()
def report(**fields):
    fields["elapsed"] = time.monotonic() - T0
    with open(os.path.join({out!r}, f"rank{{rank}}.json"), "w") as f:
        json.dump(fields, f)
def described(error):
    return {{"type": type(error).__name__, "message": str(error), "elapsed": time.monotonic() - T0,
            "exception": isinstance(error, Exception), "trace": traceback.format_exc()[-2500:]}}
'''


@dataclass
class Job:
    returncodes: List[int]
    reports: Dict[int, dict]
    output: str
    wall_s: float
    timed_out: bool
    leftover: bool = field(default=False)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_job(tmp_path: Path, body: str, nproc: int = 2, torchrun: bool = True, timeout_s: float = 60,
            pg_timeout_s: float = 2, torchrun_args: tuple = (), env: Optional[Dict[str, str]] = None) -> Job:
    """Run ``body`` on ``nproc`` ranks, under torchrun or (``torchrun=False``) as plain processes that
    find each other through MASTER_ADDR/PORT with no agent to stop the others when one fails."""
    out = tmp_path / f"job-{time.monotonic_ns()}"
    out.mkdir()
    script = out / "job.py"
    script.write_text(PREAMBLE.format(tests=str(Path(__file__).parent), out=str(out), pg_timeout_s=pg_timeout_s)
                      + textwrap.dedent(body))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    if torchrun:
        commands = [([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                      *torchrun_args, str(script)], env)]
    else:
        port = str(_free_port())
        commands = [([sys.executable, str(script)], {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                                                      "RANK": str(r), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(r)})
                    for r in range(nproc)]
    start = time.monotonic()
    procs = [subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for cmd, e in commands]
    timed_out, outputs = False, []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=max(1.0, timeout_s - (time.monotonic() - start)))[0])
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            outputs.append(proc.communicate()[0])
    wall = time.monotonic() - start
    leftover = any(_session_alive(proc.pid) for proc in procs)
    for proc in procs:
        if _session_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    reports = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    return Job([proc.returncode for proc in procs], reports, "\n".join(outputs), wall, timed_out, leftover)


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
