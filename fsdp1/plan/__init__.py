"""``fsdp1.plan``: the settings that fit a memory budget at the best speed, found by dry runs.

    plan = fsdp1.plan(build, batch, loss, world_size=8, device_memory="80GiB")
    print(plan)                  # the choice, its predicted peak and step cost, every candidate measured
    model = plan.apply(model)    # on the real model, in the real job

From the command line, for a Transformers config or a model factory: ``python -m fsdp1.plan --help``.
"""

from .._planner.cost import Calibration
from .._planner.plan import NoPlanFits, Plan, plan

__all__ = ["Calibration", "NoPlanFits", "Plan", "plan"]
