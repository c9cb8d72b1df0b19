"""Tests memory, counted exactly by the tools' live-storage count (``memory_estimator.measure``):
fsdp1 never holds more tensor memory than torch's FSDP1 at any moment of a training step, and the
memory estimator's dry run on the meta device predicts what a run with real tensors measures.

Both run as rank 0 of a fake process group, whose collectives complete synchronously: on gloo a
finished collective's worker thread can keep its tensors alive a moment after ``wait()`` returns
(a tiny model's whole optimizer step can fit in that moment), which would make an exact count
depend on thread scheduling.
"""

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from memory_estimator import estimate, fake_process_group, measure  # noqa: E402
from workload import VARIANTS, GPTSize  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:The `NO_SHARD` sharding strategy is deprecated:FutureWarning")

SMALL = GPTSize(vocab=96, seq=16, d_model=32, layers=3, heads=2, batch=2)


def _measure(name):
    """Two training steps of the variant on CPU tensors, counted from the wrapper's construction."""
    torch.manual_seed(0)
    base = SMALL.make_model()
    tokens = SMALL.make_batch(torch.Generator().manual_seed(0), torch.device("cpu"))
    return measure(SMALL, lambda: copy.deepcopy(base), VARIANTS[name], torch.device("cpu"), [tokens, tokens])


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("variant", ["full", "full_orig", "grad_op", "no_shard"])
def test_peak_memory_at_most_torch_fsdp1(variant, world_size):
    with fake_process_group(world_size):
        ours, theirs = _measure(f"fsdp1_{variant}"), _measure(f"torch_fsdp1_{variant}")
    assert ours.step_start == theirs.step_start, (ours, theirs)  # the same state between steps
    assert ours.peak <= theirs.peak, (ours, theirs)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("variant", ["fsdp1_full", "fsdp1_grad_op", "fsdp1_no_shard"])
def test_estimator_predicts_the_measured_peak(variant, world_size):
    with fake_process_group(world_size):
        measured = _measure(variant)
        predicted = estimate(SMALL, VARIANTS[variant])
    assert predicted.step_start == measured.step_start
    assert predicted.state == measured.state
    assert abs(predicted.peak - measured.peak) <= 0.10 * measured.peak, (predicted, measured)
