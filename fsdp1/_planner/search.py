"""The candidate search: as few dry runs as find every setting that fits, cheapest first.

Peaks move monotonically along each knob, so the search walks them from fastest to smallest and
never measures what cannot win:

* families, one per allowed precision; CPU offload only for a precision whose family fits nothing
  without it (offload trades the most speed);
* in a family, the smallest candidate first (most sharded, every block checkpointed; for FSDP1 then
  also without backward prefetch): when it does not fit, nothing in the family does;
* then sharding from the least sharded (NO_SHARD, SHARD_GRAD_OP, or every block kept gathered) to
  the most (FULL_SHARD, every block resharded); once one fits without checkpointing, more sharding
  only adds bytes, so the walk stops (NO_SHARD still lets SHARD_GRAD_OP be tried: it moves as many
  bytes with a sharded optimizer);
* for a sharding that does not fit as it is, the fewest blocks to checkpoint: activation memory
  falls about linearly with them, so the line through the closest measured pair that brackets the
  budget names the next count to measure, usually right within two runs;
* with ``fully_shard``, when the fully resharded model fits and the kept-gathered one does not, the
  same search finds how many of the last blocks can keep their parameters gathered;
* last, where the fastest candidate's exposed communication is a quarter of its step or more, the
  same candidate with int8 communication (``BlockQuantization``): one more dry run, whose bytes the
  codec really sent.

A 7B-parameter Llama plans in 12-18 dry runs of 2-3 seconds each. Each candidate measured is kept,
with its peak and (when it fits) its cost, for the plan's table.
"""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..api import ShardingStrategy
from .cost import Calibration, StepCost, step_cost
from .dry_run import DryRun, Footprint
from .settings import FSDP1, Settings


@dataclass(frozen=True)
class Candidate:
    """One measured candidate: its settings, what the dry run counted, whether it fits the budget,
    and its cost when it does."""

    settings: Settings
    footprint: Footprint
    fits: bool
    cost: Optional[StepCost]


@dataclass(frozen=True)
class Shape:
    """The job the plan is for: ranks, hybrid mesh (replicas, shard size) or None, blocks."""

    world_size: int
    mesh_shape: Optional[Tuple[int, int]]
    num_blocks: int

    @property
    def shard_size(self) -> int:
        return self.mesh_shape[1] if self.mesh_shape else self.world_size


COMMUNICATION_DOMINATES = 0.25
"""The share of a step that exposed communication takes before the search tries quantizing it."""


class Search:
    """Finds the candidates of one job that fit ``usable`` bytes a device, and what each costs."""

    def __init__(self, dry_run: DryRun, shape: Shape, api: str, usable: int, host_memory: Optional[int],
                 calibration: Calibration, param_dtypes: Sequence[Optional[torch.dtype]], allow_offload: bool) -> None:
        self.dry_run, self.shape, self.api, self.usable, self.host_memory = dry_run, shape, api, usable, host_memory
        self.calibration, self.param_dtypes, self.allow_offload = calibration, param_dtypes, allow_offload
        self.measured: Dict[Settings, Candidate] = {}
        self.checkpointing_error: Optional[str] = None  # why checkpointing cannot run on this model

    def run(self, use_orig_params: bool) -> List[Candidate]:
        """Every candidate measured, in the order measured."""
        with self.dry_run.process_group(self.shape.world_size):
            for dtype in self.param_dtypes:
                base = Settings(self.api, ShardingStrategy.FULL_SHARD, param_dtype=dtype, use_orig_params=use_orig_params)
                if not self._family(base) and self._offload_useful():
                    self._family(base.replace(offload=True))
            self._quantized_where_communication_dominates()
        return list(self.measured.values())

    def _quantized_where_communication_dominates(self) -> None:
        """The fastest fitting candidate again with int8 communication, when the communication its
        compute does not hide is at least ``COMMUNICATION_DOMINATES`` of its step (and the codec's
        rate was measured): a quarter of the bytes, for the codec's time and its buffers' memory."""
        fitting = [(c.settings, c.cost) for c in self.measured.values() if c.cost is not None]
        if not fitting or self.calibration.codec_s_per_value is None or self.shape.shard_size < 2:
            return
        settings, cost = min(fitting, key=lambda pair: pair[1].total)
        if cost.exposed_comm >= COMMUNICATION_DOMINATES * cost.total:
            self.measure(settings.replace(quantized=True))

    def smallest(self) -> Candidate:
        return min(self.measured.values(), key=lambda c: c.footprint.peak)

    def measure(self, settings: Settings) -> Candidate:
        if settings not in self.measured:
            footprint = self.dry_run.measure(settings)
            fits = self.fits(footprint)
            cost = step_cost(settings, footprint, self.calibration, self.shape.shard_size, self.shape.world_size) if fits else None
            self.measured[settings] = Candidate(settings, footprint, fits, cost)
        return self.measured[settings]

    def fits(self, footprint: Footprint) -> bool:
        return footprint.peak <= self.usable and (self.host_memory is None or footprint.host <= self.host_memory)

    def _offload_useful(self) -> bool:
        return self.allow_offload and self.dry_run.device_type != "cpu"  # on a CPU the host is the device

    def _family(self, base: Settings) -> bool:
        """Measure the shardings of one precision and offload; whether any fits. The smallest candidate
        first: when it does not fit, nothing of the family does."""
        smallest = self._shardings(base)[-1].replace(checkpointed=self._most_checkpointed(base))
        if not self.measure(smallest).fits:
            return base.api == FSDP1 and self.measure(smallest.replace(backward_prefetch=None)).fits
        found = False
        for sharding in self._shardings(base):
            fitting = self._fewest_checkpointed(sharding)
            found |= fitting is not None
            if fitting is not None and fitting.settings.checkpointed == 0 and sharding.strategy is not ShardingStrategy.NO_SHARD:
                break
        if base.api != FSDP1:
            found |= self._partly_gathered(base)
        return found

    def _shardings(self, base: Settings) -> List[Settings]:
        n = self.shape.num_blocks
        if base.api != FSDP1:
            return [base.replace(strategy=ShardingStrategy.SHARD_GRAD_OP, kept_gathered=n), base]
        if self.shape.mesh_shape is not None:
            strategies = [ShardingStrategy._HYBRID_SHARD_ZERO2, ShardingStrategy.HYBRID_SHARD]
        else:
            strategies = [ShardingStrategy.NO_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.FULL_SHARD]
        return [base.replace(strategy=s) for s in strategies]

    def _fewest_checkpointed(self, settings: Settings) -> Optional[Candidate]:
        """The candidate of ``settings``' sharding with the fewest blocks checkpointed that fits."""
        return self._smallest_fitting(lambda k: settings.replace(checkpointed=k), 0, self._most_checkpointed(settings))

    def _most_checkpointed(self, settings: Settings) -> int:
        """Every block, when checkpointing runs on this model (tried once, on the first candidate that
        checkpoints); else none, and ``checkpointing_error`` says why."""
        if self.checkpointing_error is None and not any(s.checkpointed for s in self.measured):
            try:
                self.measure(settings.replace(checkpointed=self.shape.num_blocks))
            except Exception as error:  # e.g. a Transformers model that caches keys and values (T5's use_cache)
                self.checkpointing_error = f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
        return 0 if self.checkpointing_error else self.shape.num_blocks

    def _partly_gathered(self, base: Settings) -> bool:
        """With ``fully_shard``: the most blocks kept gathered that fit without checkpointing, when the
        two ends straddle the budget."""
        n = self.shape.num_blocks
        kept = self.measure(base.replace(kept_gathered=n, strategy=ShardingStrategy.SHARD_GRAD_OP))
        if kept.fits:
            return False
        resharded = self.measure(base)
        if not resharded.fits:
            return False
        most = self._largest_fitting(lambda m: base.replace(kept_gathered=m), resharded, kept)
        return most is not None

    def _smallest_fitting(self, make: Callable[[int], Settings], low: int, high: int) -> Optional[Candidate]:
        """The smallest ``k`` in [low, high] whose ``make(k)`` fits, peaks falling as ``k`` grows: the
        ends, then the line through the closest measured pair that brackets the budget."""
        below = self.measure(make(low))
        if below.fits or high == low:
            return below if below.fits else None
        above = self.measure(make(high))
        if not above.fits:
            return None
        while above.settings.checkpointed - below.settings.checkpointed > 1:
            k = _crossing(below, above, self.usable, up=True)
            found = self.measure(make(k))
            below, above = (below, found) if found.fits else (found, above)
        return above

    def _largest_fitting(self, make: Callable[[int], Settings], below: Candidate, above: Candidate) -> Optional[Candidate]:
        """The largest ``m`` whose ``make(m)`` fits, peaks rising with ``m`` (``below`` fits, ``above`` not)."""
        while above.settings.kept_gathered - below.settings.kept_gathered > 1:
            m = _crossing(below, above, self.usable, up=False)
            found = self.measure(make(m))
            below, above = (found, above) if found.fits else (below, found)
        return below if below.settings.kept_gathered > 0 else None


def _crossing(one: Candidate, other: Candidate, budget: int, up: bool) -> int:
    """Strictly between the two candidates' counts (checkpointed blocks when ``up``, peaks falling;
    else blocks kept gathered, peaks rising): where the line through their peaks meets the budget."""
    def count(c: Candidate) -> int:
        return c.settings.checkpointed if up else c.settings.kept_gathered

    low, high = count(one), count(other)
    if other.footprint.peak == one.footprint.peak:
        return (low + high) // 2
    exact = low + (budget - one.footprint.peak) * (high - low) / (other.footprint.peak - one.footprint.peak)
    rounded = int(-(-exact // 1)) if up else int(exact // 1)
    return max(low + 1, min(high - 1, rounded))
