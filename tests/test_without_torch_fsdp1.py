"""fsdp1's FSDP1 needs nothing of torch's: in a process where torch's FSDP1 modules are refused to
all but torch's FSDP2 and DCP (``tests/without_torch_fsdp1/sitecustomize.py``, as torch will be once
it drops FSDP1), an FSDP1 model trains, saves a SHARDED checkpoint through ``fsdp1.checkpoint`` and
resumes from it bit for bit, and ``use_as_torch_fsdp()`` puts fsdp1's class at torch's paths, while
the script's own reach for torch's FSDP1 is refused. ``make test-without-torch-fsdp1`` runs the
whole suite so."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = '''
import json, sys
import torch, torch.distributed as dist
from torch import nn
import fsdp1, fsdp1.checkpoint
from fsdp1.wrap import ModuleWrapPolicy

dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + "/store", rank=0, world_size=1)

def trained(steps, start=0, load=None):
    torch.manual_seed(0)
    model = fsdp1.FullyShardedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)),
                                           auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    settings = (fsdp1.StateDictType.SHARDED_STATE_DICT,)
    if load is not None:
        with fsdp1.FullyShardedDataParallel.state_dict_type(model, *settings):
            state = {"model": model.state_dict(), "optim": fsdp1.FullyShardedDataParallel.optim_state_dict(model, optim)}
            fsdp1.checkpoint.load(state, load)
            model.load_state_dict(state["model"])
            optim.load_state_dict(fsdp1.FullyShardedDataParallel.optim_state_dict_to_load(model, optim, state["optim"]))
    losses = []
    for step in range(start, start + steps):
        loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return model, optim, losses

whole = trained(4)[2]
model, optim, first = trained(2)
with fsdp1.FullyShardedDataParallel.state_dict_type(model, fsdp1.StateDictType.SHARDED_STATE_DICT):
    fsdp1.checkpoint.save({"model": model.state_dict(),
                           "optim": fsdp1.FullyShardedDataParallel.optim_state_dict(model, optim)}, sys.argv[1] + "/ckpt")
resumed = first + trained(2, start=2, load=sys.argv[1] + "/ckpt")[2]
try:
    from torch.distributed.fsdp import FullyShardedDataParallel
    refused = None
except ModuleNotFoundError as error:
    refused = type(error).__name__
with fsdp1.use_as_torch_fsdp():
    from torch.distributed.fsdp import FullyShardedDataParallel as AtTorchsPath
    from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel as AtItsModule
print(json.dumps({"resumed_bitwise": resumed == whole, "refused": refused,
                  "alias": AtTorchsPath is AtItsModule is fsdp1.FullyShardedDataParallel}))
'''


def test_fsdp1_trains_saves_and_resumes_with_torchs_fsdp1_refused(tmp_path):
    env = {**os.environ, "FSDP1_WITHOUT_TORCH_FSDP1": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "without_torch_fsdp1"), str(ROOT)])}
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert json.loads(run.stdout.splitlines()[-1]) == {"resumed_bitwise": True, "refused": "TorchFSDP1Removed",
                                                       "alias": True}
