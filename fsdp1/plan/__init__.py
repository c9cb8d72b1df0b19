"""``fsdp1.plan``: the settings that fit a memory budget at the best speed, found by dry runs.

    plan = fsdp1.plan(build, batch, loss, world_size=8, device_memory="80GiB")
    print(plan)                  # the choice, its predicted peak and step cost, every candidate measured
    model = plan.apply(model)    # on the real model, in the real job

Planning a GPU job on a machine without that GPU: ``calibration="h100-sxm"`` (or
``profile("a100-80gb", gpus_per_node=4)``) costs the step with the GPU's published rates.

From the command line, for a Transformers config or a model factory: ``python -m fsdp1.plan --help``.
"""

from .._planner.cost import Calibration
from .._planner.plan import NoPlanFits, Plan, plan
from .._planner.profiles import NETWORKS, PROFILES, profile

__all__ = ["Calibration", "NETWORKS", "NoPlanFits", "PROFILES", "Plan", "plan", "profile"]
