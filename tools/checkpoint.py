"""Inspect, consolidate and convert torch.distributed.checkpoint (DCP) checkpoints in one process.

    python tools/checkpoint.py inspect CKPT_DIR [--json]
    python tools/checkpoint.py consolidate CKPT_DIR model.pt [--prefix model.] [--force]
    python tools/checkpoint.py consolidate CKPT_DIR model.safetensors [--prefix model.] [--force]
    python tools/checkpoint.py to-dcp model.pt CKPT_DIR [--force]    (or model.safetensors)

CKPT_DIR is what ``dcp.save(state_dict, checkpoint_id=CKPT_DIR)`` wrote, on any number of ranks
(e.g. a SHARDED_STATE_DICT: one DTensor per parameter). No process group is needed: ``inspect``
reads only ``.metadata`` (bytes are the unsharded numel × itemsize; chunks are the stored pieces,
one per rank that held part of the tensor); ``consolidate`` reads every piece into this process, so
it needs memory for the entries it keeps.

``consolidate`` to a ``.pt`` file without ``--prefix`` writes what the ranks passed to ``dcp.save``,
nesting included (torch's ``dcp_to_torch_save`` does it). ``--prefix P`` keeps the keys
``inspect`` lists that start with P, strips P and reads only those, so ``--prefix model.`` turns
``{"model": ..., "optim": ...}`` into the model's flat state dict. A ``.safetensors`` file also
gets the flat keys ``inspect`` lists; it holds tensors only, so a non-tensor entry is an error that
names it (select tensors with ``--prefix``, or write a ``.pt``). Tied weights: DCP stores every key
of a tied pair (the data twice) and each key is read into its own tensor, so both keys reach the
output, ``load_state_dict(strict=True)`` finds them, and safetensors' refusal of shared storage
never arises. ``to-dcp`` also writes both keys of a ``.pt`` whose tied entries share storage; its
output loads with ``dcp.load`` on any number of ranks, DCP resharding on load.

Outputs are written under a temporary name beside the target, synced, then renamed onto it, so a
crash never leaves a partial file (or checkpoint directory) under the final name; ``--force``
replaces an existing output only at that rename. ``.metadata`` and DCP's non-tensor entries are
pickles: open only checkpoints you trust. ``to-dcp`` loads ``.pt`` files with
``weights_only=True`` (torch's ``torch_save_to_dcp`` unpickles anything, and writes in place).
torch is imported only once the paths are checked, so a wrong path fails at once, not after
torch's import (seconds).
"""

import argparse
import contextlib
import importlib.util
import json
import math
import os
import secrets
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator

StateDict = dict[str, Any]
MIB = 1024 * 1024
SAFETENSORS = ".safetensors"
# DCP warns that no process group exists, which is this tool's premise.
NO_PROCESS_GROUP_WARNING = r"torch\.distributed is "


class UserError(Exception):
    """A wrong path or input, reported as one line naming it and the fix, without a traceback."""


def _require_checkpoint(path: Path) -> None:
    if not path.is_dir():
        raise UserError(f"{path}: no such directory; pass the directory that dcp.save(checkpoint_id=...) wrote")
    if not (path / ".metadata").is_file():
        raise UserError(f"{path}: no .metadata file, so not a DCP checkpoint (or its save never finished); "
                        "pass the directory that dcp.save(checkpoint_id=...) wrote")


def _require_input_file(path: Path) -> None:
    if not path.is_file():
        raise UserError(f"{path}: no such file; pass a torch.save'd state dict or a {SAFETENSORS} file")


def _require_output(path: Path, force: bool, is_dir: bool) -> None:
    """Refuse an output that cannot be written, or would replace something without ``--force``."""
    if not path.parent.is_dir():
        raise UserError(f"{path.parent}: no such directory; create it first")
    if not is_dir and path.is_dir():
        raise UserError(f"{path}: is a directory; name the file to write")
    is_empty_dir = is_dir and path.is_dir() and not any(path.iterdir())
    if path.exists() and not is_empty_dir and not force:
        raise UserError(f"{path}: already exists; pass --force to replace it")


def _require_safetensors(path: Path) -> None:
    if importlib.util.find_spec("safetensors") is None:
        raise UserError(f"{path}: {SAFETENSORS} files need the safetensors package; pip install safetensors")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextlib.contextmanager
def _staged(path: Path, is_dir: bool) -> Iterator[Path]:
    """Yield a fresh path beside ``path`` to write; when the block succeeds, rename it onto ``path``.

    The data is synced before the rename and the directory after it: a rename can survive a power
    loss that unsynced data does not. A directory cannot be renamed onto a non-empty one, so an old
    ``path`` is renamed aside first and removed only once the new one is in place.
    """
    # Not tempfile.mkstemp/mkdtemp: they create owner-only files, and the output should get the umask's.
    staged = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    if is_dir:
        staged.mkdir()
    aside = staged.with_name(staged.name + ".old")
    try:
        yield staged
        _fsync(staged)
        if is_dir and path.exists():
            os.replace(path, aside)
        os.replace(staged, path)
    finally:
        _remove(staged)
    _remove(aside)
    _fsync(path.parent)


def _first_line(error: BaseException) -> str:
    """The error's type and first line: the report stays one line when torch's message has several."""
    first_line = str(error).partition("\n")[0]
    return f"{type(error).__name__}: {first_line}" if first_line else type(error).__name__


def _verify_if_committed(path: Path) -> None:
    """An fsdp1 checkpoint (one with a manifest) must match it file for file; a plain DCP one is
    read as it is. After the path checks: this imports torch."""
    from fsdp1 import checkpoint

    if checkpoint.is_committed(path):
        try:
            checkpoint.verify(path)
        except checkpoint.CheckpointError as error:
            raise UserError(str(error)) from None


def _read_metadata(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(path).read_metadata()
    except Exception as error:  # a damaged pickle raises almost anything
        raise UserError(f"{path / '.metadata'}: cannot be read ({_first_line(error)}); "
                        "the checkpoint is damaged or from an incompatible torch") from error


@contextlib.contextmanager
def _reading_data(directory: Path) -> Iterator[None]:
    """Report a missing or damaged data file of the checkpoint as a user error.

    DCP wraps what its reader raised in a CheckpointException, which is a BaseException, not an
    Exception; any other exception (a failed write, say) passes through.
    """
    from torch.distributed.checkpoint import CheckpointException

    try:
        yield
    except CheckpointException as error:
        cause = next(iter(error.failures.values()))[0]
        raise UserError(f"{directory}: a data file is missing or damaged ({_first_line(cause)})") from error


def _describe(key: str, storage: Any) -> dict[str, Any]:
    """One entry of ``.metadata`` as ``inspect`` reports it."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not isinstance(storage, TensorStorageMetadata):
        return {"key": key, "type": "object"}
    dtype = storage.properties.dtype
    return {"key": key, "type": "tensor", "shape": list(storage.size), "dtype": str(dtype).removeprefix("torch."),
            "nbytes": math.prod(storage.size) * dtype.itemsize, "chunks": len(storage.chunks)}


def _table(entries: list[dict[str, Any]]) -> list[str]:
    rows = [("key", "shape", "dtype", "bytes", "chunks")]
    for entry in entries:
        if entry["type"] == "tensor":
            rows.append((entry["key"], str(tuple(entry["shape"])), entry["dtype"], str(entry["nbytes"]),
                         str(entry["chunks"])))
        else:
            rows.append((entry["key"], "object", "-", "-", "-"))
    widths = [max(len(row[column]) for row in rows) for column in range(5)]
    return ["  ".join([*(cell.ljust(width) for cell, width in zip(row[:3], widths)),
                       *(cell.rjust(width) for cell, width in zip(row[3:], widths[3:]))]).rstrip()
            for row in rows]


def inspect(args: argparse.Namespace) -> None:
    """Print every entry of a checkpoint's ``.metadata``, sorted by key, then the totals."""
    directory = Path(args.dir)
    _require_checkpoint(directory)
    _verify_if_committed(directory)
    metadata = _read_metadata(directory)
    entries = [_describe(key, storage) for key, storage in sorted(metadata.state_dict_metadata.items())]
    tensors = [entry for entry in entries if entry["type"] == "tensor"]
    total = {"entries": len(entries), "tensors": len(tensors), "objects": len(entries) - len(tensors),
             "nbytes": sum(entry["nbytes"] for entry in tensors)}
    if args.json:
        print(json.dumps({"entries": entries, "total": total}, indent=1))
        return
    print("\n".join(_table(entries)))
    print(f"total: entries {total['entries']} (tensors {total['tensors']}, objects {total['objects']}), "
          f"{total['nbytes']} bytes of tensors ({total['nbytes'] / MIB:,.2f} MiB)")


def _select(directory: Path, stored: dict[str, Any], prefix: str, tensors_only: bool) -> StateDict:
    """Read the entries whose keys (as ``inspect`` lists them) start with ``prefix``, and strip it."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    keys = sorted(key for key in stored if key.startswith(prefix))
    if not keys:
        raise UserError(f"{directory}: no key starts with {prefix!r}; `inspect {directory}` lists the keys")
    objects = [key for key in keys if not isinstance(stored[key], TensorStorageMetadata)]
    if tensors_only and objects:
        raise UserError(f"{directory}: entries {', '.join(objects)} are not tensors, and {SAFETENSORS} holds "
                        "tensors only; keep tensors with --prefix (e.g. --prefix model.) or write a .pt file")
    # dcp.load fills each tensor in place and replaces each object's None. Not torch's
    # _EmptyStateDictLoadPlanner(keys=...): it fails on a checkpoint saved without flattening.
    state_dict = {key: None if key in objects else torch.empty(stored[key].size, dtype=stored[key].properties.dtype)
                  for key in keys}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NO_PROCESS_GROUP_WARNING)
        dcp.load(state_dict, checkpoint_id=directory, no_dist=True)
    return {key[len(prefix):]: value for key, value in state_dict.items()}


def _save_flat(state_dict: StateDict, path: Path, is_safetensors: bool) -> None:
    if is_safetensors:
        from safetensors.torch import save_file

        # Hugging Face loaders check this header field.
        save_file(state_dict, path, metadata={"format": "pt"})
    else:
        import torch

        torch.save(state_dict, path)


def consolidate(args: argparse.Namespace) -> None:
    """Write a checkpoint as one unsharded state dict: a torch.save file, or a safetensors file."""
    directory, out = Path(args.dir), Path(args.out)
    is_safetensors = out.suffix == SAFETENSORS
    _require_checkpoint(directory)
    _require_output(out, args.force, is_dir=False)
    if is_safetensors:
        _require_safetensors(out)
    _verify_if_committed(directory)
    stored = _read_metadata(directory).state_dict_metadata
    prefix = args.prefix or ""
    prefix += "" if not prefix or prefix.endswith(".") else "."  # a module path: "model" means "model."
    if prefix or is_safetensors:
        with _reading_data(directory):
            state_dict = _select(directory, stored, prefix, tensors_only=is_safetensors)
        with _staged(out, is_dir=False) as staged:
            _save_flat(state_dict, staged, is_safetensors)
    else:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with _staged(out, is_dir=False) as staged, _reading_data(directory):
            dcp_to_torch_save(directory, staged)
    print(f"wrote {out}")


def _read_state_dict(path: Path) -> StateDict:
    """A full state dict from a torch.save file (tensors and plain values only) or a safetensors file."""
    if path.suffix == SAFETENSORS:
        _require_safetensors(path)
        from safetensors.torch import load_file

        try:
            return load_file(path)
        except Exception as error:  # SafetensorError, OSError
            raise UserError(f"{path}: not a readable {SAFETENSORS} file ({_first_line(error)})") from error
    import torch

    try:
        # map_location: a state dict saved from GPUs converts on a machine without them.
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch.load reports a damaged file as a refused pickle, or a KeyError
        raise UserError(f"{path}: torch.load(weights_only=True) cannot read it ({type(error).__name__}): it is not "
                        "a torch.save file, or holds objects other than tensors and plain values (dict, list, str, "
                        "int, float)") from error
    if not isinstance(state_dict, dict):
        raise UserError(f"{path}: holds a {type(state_dict).__name__}, not a state dict; save model.state_dict()")
    return state_dict


def to_dcp(args: argparse.Namespace) -> None:
    """Write a full state dict file as a DCP checkpoint directory."""
    source, directory = Path(args.file), Path(args.dir)
    _require_input_file(source)
    _require_output(directory, args.force, is_dir=True)
    state_dict = _read_state_dict(source)
    import torch.distributed.checkpoint as dcp

    with _staged(directory, is_dir=True) as staged, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NO_PROCESS_GROUP_WARNING)
        dcp.save(state_dict, checkpoint_id=staged, no_dist=True)
        from fsdp1 import checkpoint

        checkpoint.seal_written_by_one_process(staged)  # committed: fsdp1.checkpoint.load takes it
    print(f"wrote {directory}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(required=True, metavar="command")
    command = commands.add_parser("inspect", help="list the entries of a DCP checkpoint")
    command.add_argument("dir", metavar="DIR")
    command.add_argument("--json", action="store_true", help="print the listing as JSON")
    command.set_defaults(run=inspect)
    command = commands.add_parser("consolidate", help="write a DCP checkpoint as one .pt or .safetensors file")
    command.add_argument("dir", metavar="DIR")
    command.add_argument("out", metavar="OUT", help=f"the file to write; {SAFETENSORS} for safetensors")
    command.add_argument("--prefix", help="keep only the keys below PREFIX (e.g. model. or model), and strip it")
    command.add_argument("--force", action="store_true", help="replace OUT if it exists")
    command.set_defaults(run=consolidate)
    command = commands.add_parser("to-dcp", help="write a .pt or .safetensors state dict as a DCP checkpoint")
    command.add_argument("file", metavar="FILE")
    command.add_argument("dir", metavar="DIR")
    command.add_argument("--force", action="store_true", help="replace DIR if it exists and is not empty")
    command.set_defaults(run=to_dcp)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; a user error prints one line to stderr and returns 1."""
    args = _parser().parse_args(argv)
    try:
        args.run(args)
    except UserError as error:
        print(f"checkpoint.py: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
