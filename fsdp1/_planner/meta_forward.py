"""What a forward reads that the meta device does not hold: values, and kernels it refuses.

A training forward reads values where it decides a shape or a branch: Transformers builds its
attention mask from the padding mask and checks ``position_ids`` for packed sequences, a loss counts
the labels that are not -100, a model calls ``.item()``. On the meta device those calls fail, so
``MetaForward`` keeps a CPU twin of every meta tensor whose values are known (the batch, what
deterministic factories such as ``arange`` make, and everything computed from those alone) and
answers the calls that need values from the twins. A value computed from the weights has no twin
(the dry run never allocates them), so a forward whose shapes follow the weights (a router that
drops tokens by their scores) gets an error naming the operation and the module.

It also runs the one kernel whose meta version refuses what the real ones take: ``_grouped_mm``
(Transformers' mixture-of-experts layers) checks its meta inputs for bfloat16 as CUDA does, while the
CPU kernel multiplies float32 too; its shapes are those of the same call in bfloat16.

It also spares the dry run a third of its time: torch's meta kernels are Python functions for many
operations (the pointwise ones, layer norm, the losses), and a dry run calls the same operation on
the same shapes again and again (every block alike, every candidate of a search). An operation whose
outputs are new tensors, once run on inputs of given shapes, strides and dtypes, makes its outputs'
shapes directly from then on.

Its own work is invisible to the modes entered after it (the storage tracker, the FLOP and byte
counters): it is entered first, so it runs below them.
"""

import functools
from typing import Any, Callable, Dict, Hashable, List, NamedTuple, Optional, Tuple

import torch
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

from .._engine.traversal import clean_fqn
from .._torch_internals import TorchDispatchMode, is_grouped_mm, op_schema, storage_key, tree_leaves, tree_map, view_base

META = torch.device("meta")
CPU = torch.device("cpu")
TWIN_LIMIT = 1 << 24
"""The most elements a twin holds: a known tensor larger than this (an attention mask of a long
sequence, say) costs host memory the plan should not, and loses its values."""

_VALUE_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
_NO_VALUES = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided, torch.ops.aten.new_empty,
              torch.ops.aten.new_empty_strided}
"""Factories whose outputs hold whatever the memory held: no values to know."""
_SCALARS = (bool, int, float, complex, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


class ValuesUnknown(ValueError):
    """A forward read values the dry run does not have."""


class MetaForward(TorchDispatchMode):
    """While entered, meta tensors keep CPU twins of known values (see the module's docstring);
    ``to_meta`` moves a batch to the meta device with its values, ``naming`` names the modules of a
    model in errors. ``shapes``: the operations' output shapes seen so far (an ``OutputShapes`` dict,
    which the dry runs of one workload share)."""

    def __init__(self, shapes: "OutputShapes") -> None:
        super().__init__()
        self._twins = WeakTensorKeyDictionary()
        self._names: Dict[int, str] = {}
        self._shapes = shapes
        self._running: List[nn.Module] = []
        self._hooks: List[Any] = []

    def to_meta(self, batch: Any) -> Any:
        """``batch`` with its tensors on the meta device, each remembering its values."""
        def move(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor) or leaf.device == META:
                return leaf
            meta = leaf.to(META)
            self._twins[meta] = leaf.detach().to(CPU)
            return meta
        return tree_map(move, batch)

    def naming(self, model: nn.Module) -> None:
        """Errors name ``model``'s modules by their paths in it."""
        self._names = {id(module): clean_fqn(name) or "the model" for name, module in model.named_modules()}

    def __enter__(self) -> "MetaForward":
        self._hooks = [nn.modules.module.register_module_forward_pre_hook(lambda module, args: self._running.append(module)),
                       nn.modules.module.register_module_forward_hook(self._left, always_call=True)]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self._running.clear()
        super().__exit__(*exc)

    def _left(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._running and self._running[-1] is module:
            self._running.pop()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        facts = _facts(func)
        metas = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.device == META]
        if metas and facts.reads_values:
            if all(t in self._twins for t in metas):
                return self._from_twins(func, args, kwargs)
            try:  # some uses have static shapes (indexing with integers rather than a mask)
                return func(*args, **kwargs)
            except (RuntimeError, NotImplementedError) as error:
                raise ValuesUnknown(self._unknown(func)) from error
        if is_grouped_mm(func) and metas and metas[0].dtype != torch.bfloat16:
            return _grouped_mm_shaped_as_bfloat16(func, args, kwargs)
        out = self._outputs(func, facts, args, kwargs)
        known = facts.values_follow and all(t in self._twins for t in metas)
        if known or facts.writes:  # else its outputs are new, with no twin to give or to forget
            self._follow(func, args, kwargs, known, out)
        return out

    def _outputs(self, func: Any, facts: "_OpFacts", args: Any, kwargs: Any) -> Any:
        """``func``'s outputs on meta tensors: made from the shapes it gave on inputs like these
        before, where its outputs are new tensors, else from its meta kernel."""
        signature = _signature((args, kwargs)) if facts.new_outputs else None
        if signature is None:
            return func(*args, **kwargs)
        key = (func, signature)
        if key in self._shapes:
            shapes = self._shapes[key]
            return func(*args, **kwargs) if shapes is None else shapes.made()
        out = func(*args, **kwargs)
        self._shapes[key] = _Shapes.of(out, args, kwargs)
        return out

    def _follow(self, func: Any, args: Any, kwargs: Any, known: bool, out: Any) -> None:
        """Give ``out``'s meta tensors twins where the operation's values follow from its inputs, all
        ``known``; else forget the twins of what it wrote."""
        outputs = [t for t in tree_leaves((out, _written(func, args, kwargs))) if isinstance(t, torch.Tensor) and t.device == META]
        twins = self._computed(func, args, kwargs) if outputs and known and all(t.numel() <= TWIN_LIMIT for t in outputs) else None
        if twins is None:
            for tensor in outputs:
                self._forget(tensor)
            return
        for tensor, twin in zip(outputs, twins):
            self._twins[tensor] = twin

    def _computed(self, func: Any, args: Any, kwargs: Any) -> Optional[List[torch.Tensor]]:
        """The tensors ``func`` returns on the twins, or None where the CPU lacks its kernel (a dtype)."""
        try:
            out = func(*self._on_cpu(args), **self._on_cpu(kwargs))
        except (RuntimeError, NotImplementedError):
            return None
        return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]

    def _forget(self, tensor: torch.Tensor) -> None:
        """``tensor`` has values no twin holds; so does what it is a view of."""
        for alias in (tensor, view_base(tensor)):
            if alias is not None and alias in self._twins:
                del self._twins[alias]

    def _from_twins(self, func: Any, args: Any, kwargs: Any) -> Any:
        """An operation that reads values, computed on the twins; its tensors return to the meta
        device (with their twins)."""
        out = func(*self._on_cpu(args), **self._on_cpu(kwargs))

        def back(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            meta = torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype, device=META)
            self._twins[meta] = leaf
            return meta
        return tree_map(back, out)

    def _on_cpu(self, tree: Any) -> Any:
        def cpu(leaf: Any) -> Any:
            if isinstance(leaf, torch.Tensor) and leaf.device == META:
                return self._twins[leaf]
            return CPU if isinstance(leaf, torch.device) and leaf == META else leaf
        return tree_map(cpu, tree)

    def _unknown(self, func: Any) -> str:
        module = self._running[-1] if self._running else None
        where = "the loss" if module is None else f"{self._names.get(id(module), 'a module')!r} ({type(module).__name__})"
        return (f"fsdp1.plan: {where} reads values ({func.overloadpacket.__name__}) that the dry run does not have: it "
                "knows the batch and what is computed from the batch alone, not what the weights compute, as it never "
                "allocates them. Plan a forward whose shapes do not follow the weights' values (a Transformers mixture "
                "of experts with experts_implementation='grouped_mm'; a router with a fixed capacity per expert).")


class _OpFacts(NamedTuple):
    reads_values: bool  # its output's shape or values need its inputs' values
    values_follow: bool  # its outputs' values follow from its inputs' (not empty memory, not a random draw)
    writes: bool  # it writes an argument in place
    new_outputs: bool  # it returns only new tensors: no argument aliased or written


@functools.lru_cache(maxsize=None)
def _facts(func: Any) -> _OpFacts:
    """What ``MetaForward`` asks of each operation, read from its tags and schema once."""
    schema = op_schema(func)
    reads_values = any(tag in func.tags for tag in _VALUE_TAGS)
    aliases = any(a.alias_info is not None for a in [*schema.arguments, *schema.returns])
    return _OpFacts(reads_values=reads_values,
                    values_follow=func.overloadpacket not in _NO_VALUES and torch.Tag.nondeterministic_seeded not in func.tags,
                    writes=schema.is_mutable,
                    new_outputs=not (reads_values or aliases or schema.is_mutable or is_grouped_mm(func)) and bool(schema.returns)
                    and all(str(r.type) in ("Tensor", "Tensor[]") for r in schema.returns))


def _signature(value: Any) -> Optional[Hashable]:
    """What an operation's outputs' shapes can follow from in ``value`` (its arguments): each
    tensor's shape, strides, dtype and device, every other value itself; None where an argument is of
    a kind not known to hash by its value."""
    if isinstance(value, torch.Tensor):  # not a subclass that dispatches (a DTensor): its outputs are of its class
        plain = type(value).__torch_dispatch__ is torch.Tensor.__torch_dispatch__
        return (value.shape, value.stride(), value.storage_offset(), value.dtype, value.device) if plain else None
    if isinstance(value, (list, tuple)):
        items = tuple(_signature(item) for item in value)
        return None if None in items else (type(value), items)
    if isinstance(value, dict):
        return _signature(tuple(value.items()))
    return (type(value), value) if isinstance(value, _SCALARS) else None


class _Shapes(NamedTuple):
    """An operation's new outputs, as shapes to make them from: ``kind`` (a tensor, a tuple or a list)
    and each one's shape, strides and dtype."""

    kind: type
    tensors: Tuple[Tuple[torch.Size, Tuple[int, ...], torch.dtype], ...]

    @staticmethod
    def of(out: Any, args: Any, kwargs: Any) -> Optional["_Shapes"]:
        """``out``'s shapes, or None unless each output is a plain meta tensor with a storage of its own
        that its shape fills, as an empty tensor made from the shapes would be."""
        outs = [out] if isinstance(out, torch.Tensor) else out
        if not isinstance(outs, (list, tuple)) or not all(type(t) is torch.Tensor and t.device == META for t in outs):
            return None
        inputs = {storage_key(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        keys = [storage_key(t.untyped_storage()) for t in outs]
        if len(set(keys)) < len(keys) or inputs.intersection(keys):
            return None
        made = _Shapes(type(out), tuple((t.shape, t.stride(), t.dtype) for t in outs))
        same = all(t.storage_offset() == 0 and t.untyped_storage().nbytes() == m.untyped_storage().nbytes()
                   for t, m in zip(outs, made.tensors_made()))
        return made if same else None

    def tensors_made(self) -> List[torch.Tensor]:
        return [torch.empty_strided(shape, stride, dtype=dtype, device=META) for shape, stride, dtype in self.tensors]

    def made(self) -> Any:
        tensors = self.tensors_made()
        return self.kind(tensors) if self.kind in (tuple, list) else tensors[0]


OutputShapes = Dict[Hashable, Optional[_Shapes]]
"""Each operation and argument signature seen, with its outputs' shapes (None: run it every time)."""


def _written(func: Any, args: Any, kwargs: Any) -> List[Any]:
    """The arguments ``func`` writes in place that it does not return (a foreach update's tensors)."""
    schema = op_schema(func)
    if not schema.is_mutable or schema.returns:
        return []
    return [args[i] if i < len(args) else kwargs.get(a.name) for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write]


def _grouped_mm_shaped_as_bfloat16(func: Callable[..., Any], args: Any, kwargs: Any) -> torch.Tensor:
    """``_grouped_mm``'s output for float inputs: the meta kernel's shape for the same inputs in
    bfloat16, in the dtype the real kernel returns (``out_dtype``, else the inputs')."""
    dtype = kwargs.get("out_dtype") or next(t for t in tree_leaves(args) if isinstance(t, torch.Tensor)).dtype

    def as_bfloat16(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return torch.empty_strided(leaf.shape, leaf.stride(), dtype=torch.bfloat16, device=META)
        return leaf
    shaped = func(*tree_map(as_bfloat16, args), **{k: v for k, v in kwargs.items() if k != "out_dtype"})
    return torch.empty(shaped.shape, dtype=dtype, device=META)

