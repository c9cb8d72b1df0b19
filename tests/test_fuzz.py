"""Fuzzes fsdp1 with hypothesis: random module trees (tied weights,
frozen layers, buffers, unused layers, parameters with no elements, fewer rows than ranks) × wrap
policies (for ``fully_shard``: the modules sharded before the root) × world sizes 1–4 × options
(``FullyShardedDataParallel`` or ``fully_shard``, and each one's own) × programs of everyday and
misuse calls. Each case runs on
fresh processes with a hard deadline (``_fuzz.run_case``). Every case must either match one process
over the global batch (losses, clip norms, summoned and final parameters) on every rank, or raise
the same fsdp1 error on every rank; a hang, a crash, a rank that alone raised, or a different number
fails. 30 cases here (the same 30 every run); ``make fuzz`` runs 500 and shrinks a failure.

A second family fuzzes ``fully_shard`` in torch's training stack: meshes (1-D, HSDP, dp × tp with a
tensor-parallel plan, pp × dp under each of torch's pipeline schedules) × ``Shard(d)`` placements ×
bf16 × gradient accumulation × resharding block by block × fsdp1's import form (``import fsdp1``
alone, or under ``use_as_torch_fsdp``), each case run by fsdp1 and by torch's ``fully_shard``:
wherever torch's runs it right, fsdp1's losses and parameters are torch's bit for bit; a schedule
that splits backward over a block resharded after forward (torch's trains it silently wrong) is
refused by fsdp1 on every rank. 6 cases here; ``make fuzz`` runs 60.
"""

import os

import _fuzz_stack
import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from _fuzz import replay, run_case

EXAMPLES = int(os.environ.get("FSDP1_FUZZ_EXAMPLES", "30"))
STACK_EXAMPLES = int(os.environ.get("FSDP1_FUZZ_STACK_EXAMPLES", "6"))
# Shrinking a failure to a minimal case reruns it hundreds of times (minutes): on demand only.
PHASES = [Phase.explicit, Phase.generate] + ([Phase.shrink] if os.environ.get("FSDP1_FUZZ_SHRINK") else [])

widths = st.integers(1, 6)


def blocks(depth: int):
    leaf = st.one_of(
        st.fixed_dictionaries({"k": st.just("linear"), "out": widths, "bias": st.booleans(),
                               "frozen": st.sampled_from([False, False, False, True])}),
        st.fixed_dictionaries({"k": st.just("norm")}),
        st.fixed_dictionaries({"k": st.just("tied")}),
        st.fixed_dictionaries({"k": st.just("unused"), "out": widths}),
        st.fixed_dictionaries({"k": st.just("buffer"), "persistent": st.booleans()}),
    )
    if depth == 0:
        return st.lists(leaf, min_size=1, max_size=3)
    nested = st.fixed_dictionaries({"k": st.just("seq"), "blocks": blocks(depth - 1)})
    return st.lists(st.one_of(leaf, nested), min_size=1, max_size=3)


wrap_policies = st.one_of(
    st.just({"policy": "none"}),
    st.fixed_dictionaries({"policy": st.just("classes"), "classes": st.lists(
        st.sampled_from(["Linear", "Sequential", "LayerNorm", "Tied", "Unused", "Buffered"]), min_size=1, max_size=3,
        unique=True)}),
    st.fixed_dictionaries({"policy": st.just("size"), "min_params": st.integers(1, 64)}),
)

EVERYDAY = ["step", "step", "step", "clip", "metric_between", "no_sync", "eval", "sd_full", "sd_sharded", "summon"]
MISUSE = ["nested_summon", "forward_in_summon", "sd_rank0_only"]
programs = st.lists(st.sampled_from(EVERYDAY), min_size=1, max_size=5).flatmap(
    lambda ops: st.one_of(st.just(ops), st.sampled_from(MISUSE).map(lambda bad: ops + [bad, "step"]))
    if len(ops) > 3 else st.just(ops))

cases = st.fixed_dictionaries({
    "seed": st.integers(0, 1000),
    "world_size": st.sampled_from([1, 2, 2, 2, 3, 4]),
    "model": st.fixed_dictionaries({"width": widths, "vocab": st.sampled_from([0, 0, 5]), "blocks": blocks(2)}),
    "wrap": wrap_policies,
    "options": st.fixed_dictionaries({
        "use_orig_params": st.booleans(), "sharding": st.sampled_from(["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]),
        "sync_module_states": st.booleans(), "momentum": st.sampled_from([0.0, 0.9]),
        "api": st.sampled_from(["FullyShardedDataParallel", "FullyShardedDataParallel", "fully_shard"]),
        "reshard_after_forward": st.sampled_from([None, True, False]),
    }),
    "program": programs,
})


def _close(ours, expected, where):
    if isinstance(expected, dict):
        assert sorted(ours) == sorted(expected), (where, sorted(ours), sorted(expected))
        for key in expected:
            _close(ours[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, str):
        assert ours == expected, (where, ours)
    elif isinstance(expected, list):
        torch.testing.assert_close(torch.tensor(ours, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64),
                                   rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}")
    else:
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}")


def check(case):
    result = run_case(case)
    assert "hang" not in result, (case, result)
    assert "crash" not in result, (case, result)
    outcomes = result["outcomes"]
    errors = [outcome.get("error") for outcome in outcomes]
    if any(errors):
        assert all(errors), ("not every rank raised the same error", case, outcomes)
        assert len(set(errors)) == 1, ("not every rank raised the same error", case, outcomes)
        assert all(outcome["message"].startswith("fsdp1") for outcome in outcomes), (case, outcomes)
        return
    expected = replay(case)
    for rank, outcome in enumerate(outcomes):
        ours = outcome["ok"]
        assert len(ours["seen"]) == len(expected["seen"][rank]), (case, ours["seen"], expected["seen"][rank])
        for index, (got, want) in enumerate(zip(ours["seen"], expected["seen"][rank])):
            _close(got, want, f"rank {rank}, value {index} seen in {case}")
        _close(ours["final"], expected["final"], f"rank {rank}, final parameters of {case}")


# Cases the fuzzer found, kept: a forward refused inside summon_full_params resharded the summoned
# units; a SHARD_GRAD_OP unit no forward used crashed the end of a no_sync backward.
FOUND = [
    {'model': {'blocks': [{'k': 'unused', 'out': 6}, {'bias': False, 'frozen': False, 'k': 'linear', 'out': 1}, {'k': 'norm'}], 'vocab': 5, 'width': 1}, 'options': {'momentum': 0.9, 'sharding': 'SHARD_GRAD_OP', 'sync_module_states': True, 'use_orig_params': False, 'api': 'FullyShardedDataParallel', 'reshard_after_forward': None}, 'program': ['step', 'step', 'step', 'clip', 'forward_in_summon', 'step'], 'seed': 153, 'world_size': 3, 'wrap': {'min_params': 48, 'policy': 'size'}},
    {'model': {'blocks': [{'k': 'unused', 'out': 6}], 'vocab': 5, 'width': 4}, 'options': {'momentum': 0.9, 'sharding': 'SHARD_GRAD_OP', 'sync_module_states': True, 'use_orig_params': False, 'api': 'FullyShardedDataParallel', 'reshard_after_forward': None}, 'program': ['no_sync'], 'seed': 461, 'world_size': 2, 'wrap': {'min_params': 1, 'policy': 'size'}},
]


@pytest.mark.filterwarnings("ignore")
@example(FOUND[0])
@example(FOUND[1])
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, phases=PHASES,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases)
def test_every_case_matches_one_process_or_raises_the_same_named_error_on_every_rank(case):
    check(case)


SCHEDULES = ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
             "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"]


def _stack_case(mesh: str):
    """The draws that fit ``mesh``: tensor parallelism splits an even hidden width and keeps dim-0
    shards; a pipeline cuts 4 blocks into 2 or 4 stages, and splits its batch into micro-batches in
    place of accumulating."""
    tensor_parallel, pipelined = mesh == "dp_tp", mesh == "pp"
    return st.fixed_dictionaries({
        "seed": st.integers(0, 1000),
        "mesh": st.just(mesh),
        "world_size": st.sampled_from([2, 3, 4]) if mesh == "1d" else st.just(4),
        "width": st.integers(2, 6),
        "hidden": st.sampled_from([4, 8]) if tensor_parallel else st.integers(1, 9),
        "blocks": st.just(4) if pipelined else st.integers(1, 3),
        "shard_dim": st.just(0) if tensor_parallel else st.sampled_from([0, 0, 1]),
        "bf16": st.booleans(),
        "accumulate": st.integers(1, 2),
        "reshard_after_forward": st.lists(st.booleans(), min_size=4, max_size=4),  # block by block
        "schedule": st.sampled_from(SCHEDULES) if pipelined else st.just(None),
        "form": st.sampled_from(["plain", "alias"]),
    })


def _splits_backward_over_resharded_blocks(case):
    """torch's ``fully_shard`` trains such a case silently wrong; fsdp1 refuses it."""
    return case["schedule"] in SCHEDULES[4:] and any(case["reshard_after_forward"][:case["blocks"]])


stack_cases = st.sampled_from(["1d", "hsdp", "dp_tp", "pp"]).flatmap(_stack_case)


@pytest.mark.filterwarnings("ignore")
@example({"seed": 3, "mesh": "pp", "world_size": 4, "width": 5, "hidden": 7, "blocks": 4, "shard_dim": 1, "bf16": True,
          "accumulate": 2, "reshard_after_forward": [False] * 4, "schedule": "ScheduleZBVZeroBubble", "form": "plain"})
@example({"seed": 4, "mesh": "pp", "world_size": 4, "width": 3, "hidden": 5, "blocks": 4, "shard_dim": 0, "bf16": False,
          "accumulate": 2, "reshard_after_forward": [False, False, False, True], "schedule": "ScheduleDualPipeV",
          "form": "alias"})
@settings(max_examples=STACK_EXAMPLES, deadline=None, derandomize=True, database=None, phases=PHASES,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(stack_cases)
def test_every_stack_case_torch_runs_is_torchs_bit_for_bit(case):
    outcomes = {}
    for impl in ("torch", "fsdp1"):
        result = run_case({**case, "impl": impl}, target=_fuzz_stack.rank_main)
        assert "hang" not in result and "crash" not in result, (impl, case, result)
        outcomes[impl] = result["outcomes"]
    if _splits_backward_over_resharded_blocks(case):
        assert all("splits backward into an input pass and a weight pass" in outcome.get("message", "")
                   for outcome in outcomes["fsdp1"]), (case, outcomes["fsdp1"])
        return
    if any("error" in outcome for outcome in outcomes["torch"]):
        return  # torch's does not run it: fsdp1 may run it or refuse it
    for rank, (ours, theirs) in enumerate(zip(outcomes["fsdp1"], outcomes["torch"])):
        assert "ok" in ours, (case, rank, ours)
        assert ours["ok"] == theirs["ok"], (case, rank)
