"""Block quantization of what a collective sends (``BlockQuantization``): values cut into blocks of a
fixed number, each block sent as one-byte codes and one float32 scale.

One scale per block, not per tensor, keeps an outlier from costing the precision of every other value:
a block's codes span its own largest magnitude. Symmetric int8 rounds ``value / scale`` to the
nearest of -127..127 (``scale = max|block| / 127``), so a value comes back within half a scale, at
most ``max|block| / 254`` off; float8 e4m3 keeps three mantissa bits of ``value / scale``
(``scale = max|block| / 448``), a relative error of at most 1/16 above its subnormals. A block
holding a NaN or an infinity comes back non-finite, so that a gradient scaler still sees the overflow,
and a finite block comes back finite, subnormal values included.

What is sent is a layout's runs end to end (each parameter's part of a shard, and its padding), and a
block never mixes two of them: a LayerNorm's gains of 1.0 would otherwise set the scale of the 0.02
weights beside them and cost those weights most of their precision. A block that a run boundary cuts
(few: at most two a run) is encoded by segment, one scale for each run's part of it, and a run of a
layout's fill values encodes as zeros. Which blocks those are is worked out once for each geometry
(``BlockPlan``); a step then spends a fixed number of kernels on them, however many runs there are.

Encoding and decoding work through the values in pieces of ``_PIECE_NUMEL``, so that their float32
scratch stays that small whatever the run's length: the codec adds to a step's peak only the encoded
bytes themselves. The codec only encodes and decodes; which collective carries the bytes is the
transport's.
"""

from typing import Optional, Sequence, Set, Tuple

import torch

from .layout import Run
from .shard_math import rounded_up

SCALE_DTYPE = torch.float32
_PIECE_NUMEL = 1 << 18  # values encoded or decoded at once (1 MiB of float32 scratch)


class BlockPlan:
    """Where ``runs`` (end to end, ``numel`` values) cut a codec's blocks: the positions of every value
    in a block that holds parts of two runs or any fill value, which segment (a run's part of one such
    block) each belongs to, and whether it is a fill value. Built once for a geometry and a device."""

    def __init__(self, runs: Sequence[Run], block_size: int, device: torch.device) -> None:
        self.numel = sum(run.numel for run in runs)
        mixed: Set[int] = set()
        starts, fills, cursor = [], [], 0
        for run in runs:
            if not run.numel:
                continue
            end = cursor + run.numel
            starts.append(cursor)
            fills.append(run.fill)
            if run.fill:
                mixed.update(range(cursor // block_size, (end - 1) // block_size + 1))
            elif cursor % block_size:  # the block holds the previous run's end
                mixed.add(cursor // block_size)
            cursor = end
        blocks = torch.tensor(sorted(mixed), dtype=torch.long)
        positions = (blocks.unsqueeze(1) * block_size + torch.arange(block_size)).view(-1)
        positions = positions[positions < self.numel]
        run_of = torch.searchsorted(torch.tensor(starts, dtype=torch.long), positions, right=True) - 1
        starts_segment = torch.ones_like(positions, dtype=torch.bool)
        starts_segment[1:] = (run_of[1:] != run_of[:-1]) | (positions[1:] // block_size != positions[:-1] // block_size)
        segment_of = torch.cumsum(starts_segment, 0) - 1
        self.segments = int(segment_of[-1]) + 1 if positions.numel() else 0
        self.mixed_blocks = blocks.to(device)
        self.positions = positions.to(device)
        self.segment_of = segment_of.to(device)
        self.fill = torch.tensor(fills, dtype=torch.bool)[run_of].to(device)


class BlockCodec:
    """Encodes ``numel`` values into ``encoded_nbytes(numel, plan)`` bytes and back: the codes of every
    block of ``block_size`` values (the last one padded with zeros), 4-byte aligned, then the blocks'
    scales, then the scales of the segments of the blocks that ``plan`` says runs cut (None: one run).
    Encodings are independent, so that each rank's shard in a gather, or each destination's piece of
    an all-to-all, decodes on its own."""

    def __init__(self, dtype: torch.dtype, block_size: int) -> None:
        self.dtype, self.block_size = dtype, block_size
        self._largest = 127.0 if dtype == torch.int8 else float(torch.finfo(dtype).max)
        self._piece = max(1, _PIECE_NUMEL // block_size) * block_size

    def blocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def plan(self, runs: Sequence[Run], device: torch.device) -> BlockPlan:
        return BlockPlan(runs, self.block_size, device)

    def _codes_nbytes(self, numel: int) -> int:
        return rounded_up(self.blocks(numel) * self.block_size, 4)

    def encoded_nbytes(self, numel: int, plan: Optional[BlockPlan] = None) -> int:
        """The bytes ``numel`` values are sent as: codes, then one float32 scale a block and a segment."""
        return self._codes_nbytes(numel) + (self.blocks(numel) + (plan.segments if plan else 0)) * SCALE_DTYPE.itemsize

    def _parts(self, encoded: torch.Tensor, numel: int, plan: Optional[BlockPlan]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The codes, the blocks' scales and the segments' scales in ``encoded``."""
        codes_end = self._codes_nbytes(numel)
        scales_end = codes_end + self.blocks(numel) * SCALE_DTYPE.itemsize
        segments_end = scales_end + (plan.segments if plan else 0) * SCALE_DTYPE.itemsize
        return (encoded[:codes_end].view(self.dtype), encoded[codes_end:scales_end].view(SCALE_DTYPE),
                encoded[scales_end:segments_end].view(SCALE_DTYPE))

    def encode_into(self, values: torch.Tensor, encoded: torch.Tensor, plan: Optional[BlockPlan] = None) -> None:
        """Write ``values`` (1-D, any float dtype, laid out as ``plan``'s runs) as codes and scales into
        the uint8 ``encoded``; its bytes past ``encoded_nbytes`` (a row sized for a longer plan) are zeroed."""
        numel, block = values.numel(), self.block_size
        codes, scales, segment_scales = self._parts(encoded, numel, plan)
        codes[self.blocks(numel) * block :].zero_()  # the alignment's bytes: sent, so defined
        encoded[self.encoded_nbytes(numel, plan) :].zero_()
        for start in range(0, numel, self._piece):
            piece = values[start : start + self._piece]
            whole = piece.numel() // block * block
            first_block = start // block
            if whole:
                self._encode_blocks(piece[:whole].view(-1, block), codes[start : start + whole].view(-1, block),
                                    scales[first_block : first_block + whole // block])
            if whole < piece.numel():  # the last block, padded with zeros
                padded = piece.new_zeros(block)
                padded[: piece.numel() - whole] = piece[whole:]
                tail = first_block + whole // block
                self._encode_blocks(padded.view(1, block), codes[start + whole : start + whole + block].view(1, block),
                                    scales[tail : tail + 1])
        if plan is not None and plan.segments:
            self._encode_segments(values, codes, scales, segment_scales, plan)

    def _codes(self, values: torch.Tensor, largest: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``values`` as codes (in float32) and their scales, each group's ``largest`` magnitude
        (broadcast over its values) setting its scale: NaN where a group holds one, an infinity where
        it holds one."""
        scales = largest / self._largest
        # Divided, not multiplied by an inverse: the inverse of a subnormal scale overflows, and 0 times
        # it is NaN. A zero scale (every value zero, or too small for any scale) divides by 1: its
        # values round to zero codes, and decode to zeros.
        scaled = values.float().div(torch.where(scales > 0, scales, torch.ones_like(scales)))
        if self.dtype == torch.int8:
            scaled.round_()
        return scaled.clamp_(-self._largest, self._largest), scales  # a subnormal scale is rounded: a value may pass 127 by a few

    def _encode_blocks(self, blocks: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
        scaled, block_scales = self._codes(blocks, blocks.abs().amax(dim=1, keepdim=True).float())
        codes.copy_(scaled)
        scales.copy_(block_scales.view(-1))

    def _encode_segments(self, values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                         segment_scales: torch.Tensor, plan: BlockPlan) -> None:
        """Re-encode the blocks that runs cut, one scale a segment, a fill value as a zero; their block
        scales become 0, so that decoding them as whole blocks adds nothing."""
        picked = values.index_select(0, plan.positions).float().masked_fill_(plan.fill, 0)
        largest = picked.new_zeros(plan.segments).scatter_reduce_(0, plan.segment_of, picked.abs(), "amax")
        scaled, _ = self._codes(picked, largest.index_select(0, plan.segment_of))
        segment_scales.copy_(largest / self._largest)
        codes.view(torch.uint8).index_copy_(0, plan.positions, scaled.to(self.dtype).view(torch.uint8))
        scales.index_fill_(0, plan.mixed_blocks, 0)

    def decode_into(self, encoded: torch.Tensor, out: torch.Tensor, plan: Optional[BlockPlan] = None,
                    accumulate: bool = False) -> None:
        """The values ``encode_into`` wrote into ``encoded`` (with the same ``plan``), into the 1-D
        ``out`` (its dtype), or, with ``accumulate``, added to it."""
        numel, block = out.numel(), self.block_size
        codes, scales, segment_scales = self._parts(encoded, numel, plan)
        for start in range(0, numel, self._piece):
            length = min(self._piece, numel - start)
            blocks = self.blocks(length)
            piece_codes = codes[start : start + blocks * block].view(blocks, block)
            if self.dtype != torch.int8:  # float8 multiplies by no float32 scale: widened first
                piece_codes = piece_codes.float()
            piece_scales = scales[start // block : start // block + blocks].unsqueeze(1)
            target = out[start : start + length]
            if not accumulate and length == blocks * block:  # decoded straight into ``out``, one kernel a piece
                torch.mul(piece_codes, piece_scales, out=target.view(blocks, block))
                continue
            values = torch.mul(piece_codes, piece_scales).view(-1)[:length]
            if accumulate:
                target.add_(values)
            else:
                target.copy_(values)
        if plan is not None and plan.segments:
            picked = codes.view(torch.uint8).index_select(0, plan.positions).view(self.dtype).float()
            picked.mul_(segment_scales.index_select(0, plan.segment_of))
            if accumulate:
                out.index_add_(0, plan.positions, picked.to(out.dtype))
            else:
                out.index_copy_(0, plan.positions, picked.to(out.dtype))
