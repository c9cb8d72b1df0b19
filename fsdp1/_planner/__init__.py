"""The planner: which settings fit a memory budget at the best speed, found by dry runs on the meta
device and ranked by a cost model calibrated on the machine it runs on.

It sits above both fronts: it imports them (and ``wrap``) to apply what it plans, and nothing of
fsdp1 imports it but the public ``plan`` package.
"""
