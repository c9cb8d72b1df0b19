"""Tests the ``process_group`` argument given a process group object on a process that never called
``init_process_group`` (a stand-in group, as torch's own wrap-policy tests use): the same units,
rank, world size and shards as torch's FSDP1, and on one rank the same outputs and gradients.
(Process groups and meshes for hybrid sharding: test_hybrid_shard.)"""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _models import IMPLEMENTATIONS, fsdp_api, same_values


@pytest.mark.parametrize("size", [1, 2])
def test_a_process_group_object_without_init_process_group_is_taken_as_torchs(size):
    """A stand-in group (torch's own wrap-policy tests use one) on a process that never called
    ``init_process_group``: the same units, rank, world size and shards as torch's, and on one rank
    the same outputs (a stand-in of two ranks cannot gather: it only plans)."""
    from torch.testing._internal.common_fsdp import DummyProcessGroup

    assert not dist.is_initialized()
    seen = {}
    for name in IMPLEMENTATIONS:
        torch.manual_seed(0)
        fsdp, cpu = fsdp_api(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the world size of 1 switches to NO_SHARD, with a warning
            model = fsdp.FullyShardedDataParallel(
                nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), process_group=DummyProcessGroup(rank=0, size=size),
                auto_wrap_policy=fsdp.wrap.ModuleWrapPolicy({nn.Linear}), **cpu)
        units = [(m.rank, m.world_size) for m in model.modules() if isinstance(m, fsdp.FullyShardedDataParallel)]
        shards = [p.detach().clone() for p in model.parameters()]
        if size == 1:
            output = model(torch.ones(3, 4))
            output.sum().backward()
            seen[name] = units, shards, output, [p.grad for p in model.parameters()]
        else:
            seen[name] = units, shards
    assert same_values(seen["fsdp1"], seen["torch"])


NUMPY_FREE_JOB = """
import sys
sys.modules["numpy"] = None  # as where numpy is not installed: torch's own object collectives fail then
import torch, torch.distributed as dist
from torch import nn
import fsdp1
from fsdp1 import FullyShardedDataParallel as FSDP, StateDictType
from fsdp1.wrap import ModuleWrapPolicy
dist.init_process_group("gloo")
torch.manual_seed(0)
model = FSDP(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
             sync_module_states=True)
optim = torch.optim.Adam(model.parameters(), lr=0.1)
model(torch.randn(4, 8)).sum().backward()
optim.step()
with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
    full = FSDP.optim_state_dict(model, optim)
assert len(full["state"]) == 4
try:
    dist.all_gather_object([None, None], 1)
except RuntimeError as error:
    assert "Numpy is not available" in str(error)
else:
    raise AssertionError("numpy was available after all")
dist.destroy_process_group()
"""


def test_fsdp1_needs_no_numpy_where_torchs_object_collectives_do(tmp_path):
    """torch's object collectives need numpy, which torch does not install: a fresh environment with
    torch alone failed at the first fsdp1 construction. fsdp1's own object collectives (construction
    checks, optimizer state dicts) pickle into tensors themselves."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "job.py"
    script.write_text(NUMPY_FREE_JOB)
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
                         env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=180)
    assert run.returncode == 0, run.stderr[-4000:]
