"""Moving one unit's parameters between FSDP's flat shards and DTensor's row chunks (``Shard(0)``).

A SHARDED state dict holds each parameter split along dim 0 over the group, so that DCP can reshard
it and torch's FSDP1 can read it; the flat shard of a rank holds an arbitrary contiguous run of the
concatenated parameters instead. A rank's rows of a parameter lie in the flat shards of a rank or
two, so one all-to-all moves every piece where it belongs, about one shard of bytes, without ever
unsharding the unit (torch's FSDP1 gathers the whole unit and keeps its rows). The plan is pure
arithmetic on the flat layout; this module reads and returns tensors and never writes a shard (the
handle does).
"""

from typing import List, Optional, Sequence, Tuple

import torch

from .._engine import collectives as comm
from .._engine.shard_math import dim0_chunk_range, overlap, shard_span

Range = Tuple[int, int]


class RowRedistribution:
    """The exchange between flat shards and row chunks for one unit on one rank.

    Args:
        offsets, shapes: where each parameter lies in the unpadded flat parameter, and its shape.
        numel: the flat parameter's elements before tail padding.
        rank, world_size, group: this rank in the group the unit shards over (0 of 1 unsharded).
    """

    def __init__(self, offsets: Sequence[int], shapes: Sequence[torch.Size], numel: int,
                 rank: int, world_size: int, group: comm.ProcessGroup) -> None:
        self._offsets, self._shapes, self._numel = offsets, shapes, numel
        self._rank, self._world_size, self._group = rank, world_size, group
        self.own = self._flat_range(rank)

    def rows_of(self, local_shard: torch.Tensor) -> List[torch.Tensor]:
        """Each parameter's rows that this rank holds in the row layout, as new tensors."""
        send = [
            [self._piece(local_shard, overlap(self.own, self._rows_range(i, peer))) for i in range(len(self._shapes))]
            for peer in range(self._world_size)
        ]
        receive = [[overlap(self._flat_range(peer), self._rows_range(i, self._rank)) for i in range(len(self._shapes))]
                   for peer in range(self._world_size)]
        received = self._exchange(send, receive, local_shard)
        rows = []
        for i, shape in enumerate(self._shapes):
            count = shard_span(shape[0], self._rank, self._world_size).numel  # a zero-size dimension has no elements to count
            rows.append(torch.cat([received[peer][i] for peer in range(self._world_size)]).view(count, *shape[1:]))
        return rows

    def pieces_for(self, rows: Sequence[Optional[torch.Tensor]], local_shard: torch.Tensor) -> List[Tuple[int, torch.Tensor]]:
        """The inverse: from each parameter's rows of this rank (None for one to leave as it is, on
        every rank alike), the pieces of this rank's flat shard, as (offset in the shard, values)."""
        send = []
        for peer in range(self._world_size):
            pieces = []
            for i, chunk in enumerate(rows):
                if chunk is None:
                    pieces.append(local_shard[:0])
                    continue
                lo = self._rows_range(i, self._rank)[0]
                start, end = overlap(self._rows_range(i, self._rank), self._flat_range(peer))
                pieces.append(chunk.detach().reshape(-1)[start - lo : end - lo])
            send.append(pieces)
        receive = [
            [overlap(self._rows_range(i, peer), self.own) if chunk is not None else (0, 0) for i, chunk in enumerate(rows)]
            for peer in range(self._world_size)
        ]
        received = self._exchange(send, receive, local_shard)
        return [
            (start - self.own[0], piece)
            for ranges, pieces in zip(receive, received)
            for (start, end), piece in zip(ranges, pieces)
            if end > start
        ]

    def _flat_range(self, rank: int) -> Range:
        """The unpadded flat elements rank ``rank`` holds."""
        span = shard_span(self._numel, rank, self._world_size)
        return span.start, span.end

    def _rows_range(self, index: int, rank: int) -> Range:
        return dim0_chunk_range(self._offsets[index], self._shapes[index], rank, self._world_size)

    def _piece(self, local_shard: torch.Tensor, flat_range: Range) -> torch.Tensor:
        return local_shard[flat_range[0] - self.own[0] : flat_range[1] - self.own[0]]

    def _exchange(self, send: List[List[torch.Tensor]], receive: List[List[Range]],
                  like: torch.Tensor) -> List[List[torch.Tensor]]:
        """One all-to-all of the pieces in ``send`` (per destination rank); returns, per source rank,
        the pieces it sent, cut to the lengths of ``receive``'s ranges."""
        send_splits = [sum(piece.numel() for piece in pieces) for pieces in send]
        receive_splits = [sum(end - start for start, end in ranges) for ranges in receive]
        flat_send = torch.cat([piece.to(like.dtype) for pieces in send for piece in pieces])
        if self._world_size == 1:
            received = flat_send
        else:
            received = like.new_empty(sum(receive_splits))
            comm.all_to_all(received, flat_send, receive_splits, send_splits, self._group)
        out, cursor = [], 0
        for ranges in receive:
            pieces = []
            for start, end in ranges:
                pieces.append(received[cursor : cursor + end - start])
                cursor += end - start
            out.append(pieces)
        return out
