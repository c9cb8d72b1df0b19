"""The planner: which settings fit a memory budget at the best speed, found by dry runs on the meta
device and ranked by a cost model calibrated on the machine it runs on. Imports both fronts, to
apply what it plans."""
