"""Block quantization of what a collective sends (``BlockQuantization``): values cut into blocks of a
fixed number, each block sent as one-byte codes and one float32 scale.

One scale per block, not per tensor, keeps an outlier from costing the precision of every other value:
a block's codes span its own largest magnitude. Symmetric int8 rounds ``value / scale`` to the
nearest of -127..127 (``scale = max|block| / 127``), so a value comes back within half a scale, at
most ``max|block| / 254`` off; float8 e4m3 keeps three mantissa bits of ``value / scale``
(``scale = max|block| / 448``), a relative error of at most 1/16 above its subnormals. A block
holding a NaN or an infinity comes back non-finite, so that a gradient scaler still sees the overflow,
and a finite block comes back finite, subnormal values included.

Encoding and decoding work through a run in pieces of ``_PIECE_NUMEL`` values, so that their float32
scratch stays that small whatever the run's length: the codec adds to a step's peak only the encoded
bytes themselves. The codec only encodes and decodes; which collective carries the bytes is the
transport's.
"""

from typing import List, Optional, Sequence, Tuple

import torch

from .shard_math import rounded_up

SCALE_DTYPE = torch.float32
_PIECE_NUMEL = 1 << 18  # values encoded or decoded at once (1 MiB of float32 scratch)

PieceHoles = Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]


class BlockCodec:
    """Encodes a run of ``numel`` values into ``encoded_nbytes(numel)`` bytes and back: the codes of
    every block of ``block_size`` values (the last one padded with zeros), 4-byte aligned, then the
    blocks' scales. Runs are independent, so that each rank's shard in a gather, or each
    destination's piece of an all-to-all, decodes on its own."""

    def __init__(self, dtype: torch.dtype, block_size: int) -> None:
        self.dtype, self.block_size = dtype, block_size
        self._largest = 127.0 if dtype == torch.int8 else float(torch.finfo(dtype).max)
        self._piece = max(1, _PIECE_NUMEL // block_size) * block_size

    def blocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def _codes_nbytes(self, numel: int) -> int:
        return rounded_up(self.blocks(numel) * self.block_size, 4)

    def encoded_nbytes(self, numel: int) -> int:
        """The bytes a run of ``numel`` values is sent as: codes, then one float32 scale a block."""
        return self._codes_nbytes(numel) + self.blocks(numel) * SCALE_DTYPE.itemsize

    def holes(self, runs: Sequence[Tuple[int, int]], numel: int, device: torch.device) -> List[PieceHoles]:
        """The runs ``[start, end)`` of a run of ``numel`` values that ``encode_into`` is to take for
        zeros (a layout's fill values, which are no parameter's), by the pieces it encodes in turn:
        their positions among each piece's whole blocks and in its last, padded block."""
        holes: List[PieceHoles] = []
        for start in range(0, numel, self._piece):
            end = min(start + self._piece, numel)
            whole_end = start + (end - start) // self.block_size * self.block_size
            positions = [i for a, b in runs for i in range(max(a, start), min(b, end))]
            whole = [i - start for i in positions if i < whole_end]
            tail = [i - whole_end for i in positions if i >= whole_end]
            whole_holes, tail_holes = (torch.tensor(part, dtype=torch.long, device=device) if part else None
                                       for part in (whole, tail))
            holes.append((whole_holes, tail_holes))
        return holes

    def encode_into(self, values: torch.Tensor, encoded: torch.Tensor, holes: Optional[Sequence[PieceHoles]] = None) -> None:
        """Write ``values`` (1-D, any float dtype) as codes and scales into the uint8 ``encoded`` of
        ``encoded_nbytes(values.numel())`` bytes; ``holes`` (from ``holes``) encode as zeros."""
        numel, block = values.numel(), self.block_size
        codes = encoded[: self._codes_nbytes(numel)].view(self.dtype)
        scales = encoded[self._codes_nbytes(numel) :].view(SCALE_DTYPE)
        codes[self.blocks(numel) * block :].zero_()  # the alignment's bytes: sent, so defined
        for index, start in enumerate(range(0, numel, self._piece)):
            piece = values[start : start + self._piece]
            whole = piece.numel() // block * block
            first_block = start // block
            whole_holes, tail_holes = holes[index] if holes is not None else (None, None)
            if whole:
                self._encode_blocks(piece[:whole].view(-1, block), codes[start : start + whole].view(-1, block),
                                    scales[first_block : first_block + whole // block], whole_holes)
            if whole < piece.numel():  # the run's last block, padded with zeros
                padded = piece.new_zeros(block)
                padded[: piece.numel() - whole] = piece[whole:]
                tail = first_block + whole // block
                self._encode_blocks(padded.view(1, block), codes[start + whole : start + whole + block].view(1, block),
                                    scales[tail : tail + 1], tail_holes)

    def _encode_blocks(self, blocks: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                       holes: Optional[torch.Tensor]) -> None:
        magnitudes = blocks.abs()
        if holes is not None:
            magnitudes.view(-1).index_fill_(0, holes, 0)
        largest = magnitudes.amax(dim=1).float()  # NaN where a block holds one
        block_scales = largest / self._largest  # an infinity where the block holds one
        scales.copy_(block_scales)
        # Divided, not multiplied by an inverse: the inverse of a subnormal scale overflows, and 0 times
        # it is NaN. A zero scale (every value zero, or too small for any scale) divides by 1: its
        # values round to zero codes, and decode to zeros.
        divisor = torch.where(block_scales > 0, block_scales, torch.ones_like(block_scales))
        scaled = blocks.float().div(divisor.unsqueeze(1))
        if holes is not None:
            scaled.view(-1).index_fill_(0, holes, 0)
        if self.dtype == torch.int8:
            scaled.round_()
        scaled.clamp_(-self._largest, self._largest)  # a subnormal scale is rounded: a value may pass 127 by a few
        codes.copy_(scaled)

    def decode_into(self, encoded: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> None:
        """The values ``encode_into`` wrote into ``encoded``, into the 1-D ``out`` (its dtype), or,
        with ``accumulate``, added to it."""
        numel, block = out.numel(), self.block_size
        codes = encoded[: self._codes_nbytes(numel)].view(self.dtype)
        scales = encoded[self._codes_nbytes(numel) :].view(SCALE_DTYPE)
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
