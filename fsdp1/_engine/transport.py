"""How one unit's values travel: ``Transport`` issues every collective of a unit's gathers and of its
gradient's reduction, for both fronts.

The layout (``layout.py``) is geometry: where each parameter's values sit in the shard and in the
unsharded buffer, which runs of a shard travel (``sent_pieces``), and how the ranks' runs land in
the buffer (``gathers_in_place``, ``copy_out``). The transport decides how the bytes move, and nothing
about where they go:

* a gather goes straight into the unsharded buffer where the layout's rank-major order is its
  parameter-major one (FSDP1's flat shard: no copy), else into rows that the layout copies out; between
  two gloo ranks only the peer's shard travels (``comm.receive_peer_shard``); a user's all-gather
  (``set_custom_all_gather``) replaces the collective; the extensions' tensors (``GatherExtras``)
  travel packed in the same bytes; and with a weight codec each rank's shard travels block-quantized
  (its blocks cut where the layout's ``sent_runs`` of that rank end, so that no block mixes two
  parameters) and every rank decodes every row, its own included, so that all ranks compute on the
  same values;
* a reduction is a reduce-scatter (or the user's, ``set_custom_reduce_scatter``) of a sharded unit,
  an all-reduce of one that is not sharded and of the replicas; with a gradient codec each becomes an
  all-to-all of quantized pieces that the receiver sums in float32 with its own piece, unquantized
  (a ring would quantize at every hop and add the error up), and an all-reduce adds an all-gather of
  the quantized sums, decoded alike everywhere so that the replicas stay equal.

What a collective reads that the caller did not give (a cast of the shard, packed or encoded bytes)
is freed once the collective is done.
"""

from typing import Callable, Dict, FrozenSet, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..api import BlockQuantization
from . import collectives as comm
from .layout import GatherExtras, ParamLayout, Run, alloc_storage, free_storage, runs_between
from .quantization import BlockCodec, BlockPlan
from .shard_math import chunk_numel, rounded_up

_ROW_ALIGNMENT = 8  # every rank's row of a packed gather starts aligned for any dtype it holds


class Reduction(NamedTuple):
    """A gradient reduction in flight: its work, the input it reads (to keep alive until then), this
    rank's result once waited for, and whether the input's storage may go once it is done."""

    work: comm.Waitable
    input: torch.Tensor
    output: torch.Tensor
    frees_input: bool


class _Finishing:
    """A collective's work and what completes it on ``wait()``: a copy out of its rows, or decoding
    and summing; then the temporaries it read or wrote are freed (a gloo worker drops its reference a
    moment after the wait, which would otherwise keep them past the next allocation)."""

    def __init__(self, work: comm.Waitable, then: Optional[Callable[[], None]] = None,
                 frees: Sequence[torch.Tensor] = ()) -> None:
        self._work: Optional[comm.Waitable] = work
        self._then, self._frees = then, list(frees)

    def wait(self) -> bool:
        if self._work is None:
            return True
        work, self._work = self._work, None
        work.wait()
        then, self._then = self._then, None
        if then is not None:
            then()
        for tensor in self._frees:
            free_storage(tensor)
        self._frees = []
        return True


class Transport:
    """The collectives of one unit over ``group`` (its shard group), and of its replicas'
    all-reduce over ``replicate_group``. ``quantization`` gives the codecs; the user's collectives
    (``set_custom``) replace the default ones and exclude a codec of the same direction."""

    def __init__(self, layout: ParamLayout, group: comm.ProcessGroup, replicate_group: Optional[comm.ProcessGroup] = None,
                 quantization: Optional[BlockQuantization] = None) -> None:
        self.layout, self.group, self.replicate_group = layout, group, replicate_group
        self.weight_codec = _codec(quantization, quantization.weights if quantization else None)
        self.grad_codec = _codec(quantization, quantization.gradients if quantization else None)
        self.custom_all_gather: Optional[comm.UserAllGather] = None
        self.custom_reduce_scatter: Optional[comm.UserReduceScatter] = None
        self._plans: Dict[Tuple[object, ...], List[BlockPlan]] = {}  # each rank's (or chunk's) blocks, by geometry and device

    def set_custom(self, path: str, all_gather: Optional[comm.UserAllGather] = None,
                   reduce_scatter: Optional[comm.UserReduceScatter] = None) -> None:
        """The user's all-gather and reduce-scatter from now on (None keeps the one set)."""
        for given, codec, setter in ((all_gather, self.weight_codec, "set_custom_all_gather"),
                                     (reduce_scatter, self.grad_codec, "set_custom_reduce_scatter")):
            if given is not None and codec is not None:
                raise ValueError(
                    f"fsdp1: {setter} on '{path or '<root>'}' replaces the collective that comm_quantization quantizes: "
                    f"use one of them (comm_quantization=BlockQuantization(..., "
                    f"{'weights' if setter.endswith('gather') else 'gradients'}=None) leaves that direction to yours)")
        if all_gather is not None:
            self.custom_all_gather = all_gather
        if reduce_scatter is not None:
            self.custom_reduce_scatter = reduce_scatter

    # ----------------------------------------------------------------------------- gathers
    def all_gather(self, unsharded: torch.Tensor, shard: torch.Tensor, path: str,
                   extras: Optional[GatherExtras] = None, quantized: bool = False) -> comm.Waitable:
        """Start filling ``unsharded`` (in its dtype, on its device) from every rank's ``shard``
        (cast on the way; with ``extras``, gathering those in the same collective; ``quantized``,
        block-quantized by the weight codec, if there is one). The parameters' views of it are valid
        once the returned work is waited for; its storage may be freed: it is allocated when first
        written."""
        codec = self.weight_codec if quantized and self.layout.world_size > 1 and shard.numel() else None  # nothing to send: no codes
        if codec is None and extras is None:
            source = shard.to(device=unsharded.device, dtype=unsharded.dtype, non_blocking=True)
            work = self._gather_plain(unsharded, source, path)
        else:
            dtype = shard.dtype if codec is not None else unsharded.dtype
            source = shard.to(device=unsharded.device, dtype=dtype, non_blocking=True)
            work = self._gather_packed(unsharded, source, path, extras, codec)
        return _Finishing(work, frees=[source] if source is not shard else ())

    def _gather_plain(self, unsharded: torch.Tensor, source: torch.Tensor, path: str) -> comm.Waitable:
        layout, group, custom = self.layout, self.group, self.custom_all_gather
        if layout.gathers_in_place and (custom is None or layout.world_size == 1):
            alloc_storage(unsharded)
            return comm.all_gather_into(unsharded, source, group, path)
        work: comm.Waitable
        if custom is not None:
            gathered, work = comm.user_all_gather(custom, source, group, path)
            rows = list(enumerate(gathered.view(layout.world_size, -1).unbind()))
        elif comm.is_gloo_pair(group):
            peer = source.new_empty(layout.shard_numel)
            work = comm.receive_peer_shard(peer, source, group, path)
            rows = [(layout.rank, source), (1 - layout.rank, peer)]
        else:
            gathered = source.new_empty(layout.unsharded_numel)
            work = comm.all_gather_into(gathered, source, group, path)
            rows = list(enumerate(gathered.view(layout.world_size, -1).unbind()))
        return _Finishing(work, lambda: layout.copy_out(unsharded, iter(rows)))

    def _gather_packed(self, unsharded: torch.Tensor, source: torch.Tensor, path: str,
                       extras: Optional[GatherExtras], codec: Optional[BlockCodec]) -> comm.Waitable:
        """One gather, in bytes, of this rank's runs that travel (encoded by ``codec``, if given) and of
        the extras' inputs, as torch's FSDP2 packs a group's all-gather inputs of several dtypes into one."""
        layout, skipped = self.layout, extras.skipped if extras is not None else frozenset()
        pieces = layout.sent_pieces(source, skipped)
        numel = sum(piece.numel() for piece in pieces)
        plans = self._sent_plans(codec, skipped, source.device) if codec is not None else []
        # A row is as long as the longest rank's encoding: runs cut each rank's blocks differently.
        head_nbytes = max(codec.encoded_nbytes(numel, plan) for plan in plans) if codec is not None else numel * source.element_size()
        extra_inputs = [tensor.contiguous().view(-1).view(torch.uint8) for tensor in (extras.inputs if extras else ())]
        sizes = [head_nbytes, *(tensor.numel() for tensor in extra_inputs)]
        packed = torch.empty(rounded_up(sum(sizes), _ROW_ALIGNMENT), dtype=torch.uint8, device=source.device)
        segments = torch.split(packed, sizes + [packed.numel() - sum(sizes)])
        if codec is not None:
            values = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            codec.encode_into(values, segments[0], plans[layout.rank])
        elif pieces:
            torch.cat([piece.view(torch.uint8) for piece in pieces], out=segments[0])
        for segment, tensor in zip(segments[1:], extra_inputs):
            segment.copy_(tensor)
        segments[-1].zero_()
        work: comm.Waitable
        if self.custom_all_gather is not None:
            gathered, work = comm.user_all_gather(self.custom_all_gather, packed, self.group, path)
        else:
            gathered = packed.new_empty(packed.numel() * layout.world_size)
            work = comm.all_gather_into(gathered, packed, self.group, path)
        rows = gathered.view(layout.world_size, -1)

        def unpack() -> None:
            heads = rows[:, :head_nbytes]
            if codec is None:
                layout.copy_out(unsharded, ((rank, head.view(unsharded.dtype)) for rank, head in enumerate(heads.unbind())), skipped)
            elif layout.gathers_in_place:  # decoded straight into the buffer
                alloc_storage(unsharded)
                for rank, head in enumerate(heads.unbind()):
                    codec.decode_into(head, unsharded[rank * numel : (rank + 1) * numel], plans[rank])
            else:
                layout.copy_out(unsharded, _decoded_one_by_one(codec, heads, plans, unsharded.new_empty(numel)), skipped)
            if extras is not None:
                outputs = [output.view(layout.world_size, -1) for output in extras.outputs]
                for rank, row in enumerate(rows.unbind()):
                    for output, segment in zip(outputs, torch.split(row, sizes + [row.numel() - sum(sizes)])[1:]):
                        output[rank].copy_(segment)
                extras.finish()

        return _Finishing(work, unpack, frees=[packed] if self.custom_all_gather is not None else [packed, gathered])  # the user's buffer is theirs

    def _sent_plans(self, codec: BlockCodec, skipped: FrozenSet[int], device: torch.device) -> List[BlockPlan]:
        """The codec's plan of each rank's values that ``sent_pieces`` sends without ``skipped``, and
        of its piece of a gradient that ``reduce_input`` ordered without them."""
        world = self.layout.world_size
        return self._cached_plans(codec, ("sent", skipped), device, lambda: [self.layout.sent_runs(rank, skipped) for rank in range(world)])

    def _chunk_plans(self, codec: BlockCodec, replicas: bool, device: torch.device) -> List[BlockPlan]:
        """The codec's plan of each equal chunk that an all-reduce over the group (or the replicas)
        cuts this rank's shard into."""
        group = self.replicate_group if replicas else self.group
        assert group is not None, "only a hybrid unit has replicas"
        world = comm.group_size(group)
        chunk = chunk_numel(self.layout.shard_numel, world)

        def per_chunk() -> List[Tuple[Run, ...]]:
            runs = self.layout.sent_runs(self.layout.rank)
            return [runs_between(runs, index * chunk, (index + 1) * chunk) for index in range(world)]

        return self._cached_plans(codec, ("chunks", replicas), device, per_chunk)

    def _cached_plans(self, codec: BlockCodec, geometry: Tuple[object, ...], device: torch.device,
                      runs: Callable[[], List[Tuple[Run, ...]]]) -> List[BlockPlan]:
        """Plans are worked out once for each geometry, on its first use (a step only looks them up)."""
        key = (codec.block_size, *geometry, device)
        if key not in self._plans:
            per_rank = runs()
            unique = {each: codec.plan(each, device) for each in set(per_rank)}  # FSDP2's ranks share theirs
            self._plans[key] = [unique[each] for each in per_rank]
        return self._plans[key]

    # ----------------------------------------------------------------------------- reductions
    def reduce_scatter(self, grad: torch.Tensor, path: str, skipped: FrozenSet[int] = frozenset()) -> Reduction:
        """Start summing ``grad`` (rank-major, as ``layout.reduce_input`` orders it without
        ``skipped``) over the group, this rank's part in the result."""
        if self.custom_reduce_scatter is not None:
            reduce_input, output, work = comm.user_reduce_scatter(self.custom_reduce_scatter, grad, self.group, path)
            return Reduction(work, reduce_input, output, False)
        output = grad.new_empty(grad.numel() // self.layout.world_size)
        if self.grad_codec is not None and comm.group_size(self.group) > 1:
            plans = self._sent_plans(self.grad_codec, skipped, grad.device)
            return Reduction(self._reduce_quantized(grad, output, self.group, path, plans), grad, output, True)
        return Reduction(comm.reduce_scatter_into(output, grad, self.group, path), grad, output, True)

    def all_reduce(self, tensor: torch.Tensor, path: str, replicas: bool = False) -> comm.Waitable:
        """Start summing ``tensor`` in place over the group (a unit that is not sharded) or, with
        ``replicas``, over the replicas of a hybrid unit."""
        group = self.replicate_group if replicas else self.group
        assert group is not None, "only a hybrid unit has replicas"
        if self.grad_codec is not None and comm.group_size(group) > 1:
            return self._all_reduce_quantized(tensor, group, path, self._chunk_plans(self.grad_codec, replicas, tensor.device))
        return comm.all_reduce(tensor, group, path)

    def _reduce_quantized(self, grad: torch.Tensor, output: torch.Tensor, group: comm.ProcessGroup, path: str,
                          plans: Sequence[BlockPlan]) -> comm.Waitable:
        """Each other rank's piece of ``grad`` encoded (by its plan in ``plans``) and sent to it; this
        rank's own piece, then the pieces received in rank order, decoded and summed in float32 into
        ``output``."""
        codec = self.grad_codec
        assert codec is not None, "a quantized reduction has a gradient codec"
        world, rank = comm.group_size(group), comm.group_rank(group)
        pieces = grad.view(world, -1)
        row_nbytes = max(codec.encoded_nbytes(pieces.shape[1], plan) for plan in plans)
        send = torch.empty(world - 1, row_nbytes, dtype=torch.uint8, device=grad.device)
        for row, peer in zip(send.unbind(), (peer for peer in range(world) if peer != rank)):
            codec.encode_into(pieces[peer], row, plans[peer])
        received = torch.empty_like(send)
        work = comm.exchange_rows(received, send, group, "reduce-scatter", path)

        def summed() -> None:
            total = output if output.dtype == torch.float32 else torch.empty(output.shape, dtype=torch.float32, device=output.device)
            total.copy_(pieces[rank])
            for row in received.unbind():
                codec.decode_into(row, total, plans[rank], accumulate=True)
            if total is not output:
                output.copy_(total)

        return _Finishing(work, summed, frees=[send, received])

    def _all_reduce_quantized(self, tensor: torch.Tensor, group: comm.ProcessGroup, path: str,
                              plans: Sequence[BlockPlan]) -> comm.Waitable:
        """A quantized reduce-scatter of ``tensor`` (padded to a multiple of the ranks), then an
        all-gather of the encoded sums that every rank decodes alike, its own included, into ``tensor``."""
        codec = self.grad_codec
        assert codec is not None, "a quantized reduction has a gradient codec"
        world, numel = comm.group_size(group), tensor.numel()
        chunk = chunk_numel(numel, world)
        padded = tensor.new_zeros(world * chunk)
        padded[:numel] = tensor.view(-1)
        own = padded.new_empty(chunk)
        scattered = self._reduce_quantized(padded, own, group, path, plans)

        def gathered() -> None:
            scattered.wait()
            encoded = torch.empty(max(codec.encoded_nbytes(chunk, plan) for plan in plans), dtype=torch.uint8, device=tensor.device)
            codec.encode_into(own, encoded, plans[comm.group_rank(group)])
            rows = encoded.new_empty(world * encoded.numel())
            comm.all_gather_into(rows, encoded, group, path).wait()
            for rank, row in enumerate(rows.view(world, -1).unbind()):
                codec.decode_into(row, padded[rank * chunk : (rank + 1) * chunk], plans[rank])
            tensor.view(-1).copy_(padded[:numel])

        return _Finishing(comm.Finished(), gathered, frees=[padded])


def _codec(quantization: Optional[BlockQuantization], dtype: Optional[torch.dtype]) -> Optional[BlockCodec]:
    """The codec of one direction, or None where it sends unquantized."""
    return BlockCodec(dtype, quantization.block_size) if quantization is not None and dtype is not None else None


def _decoded_one_by_one(codec: BlockCodec, heads: torch.Tensor, plans: Sequence[BlockPlan],
                        scratch: torch.Tensor) -> Iterator[Tuple[int, torch.Tensor]]:
    """Each rank's decoded values, in one scratch row that the consumer copies out before the next."""
    for rank, head in enumerate(heads.unbind()):
        codec.decode_into(head, scratch, plans[rank])
        yield rank, scratch
