"""Checkpoints that are either complete and intact or refused: ``save`` and ``load`` around
``torch.distributed.checkpoint`` (DCP) with a commit protocol.

DCP alone marks a checkpoint complete when its ``.metadata`` lands, but a save over an existing
directory that dies half way leaves one that loads without error, half old and half new; a flipped
bit loads silently; and its errors are ``BaseException``s. Here:

- a save writes into a staging directory beside the target and takes the target's name by one
  atomic rename, so a committed checkpoint is never written into; a committed one is never
  overwritten (``CheckpointExists``);
- the commit marker, a manifest of every file's size and CRC-32 (and its own checksum), is written
  last, by rank 0, after every rank reported its files written; ``load`` verifies every file against
  it before DCP reads anything;
- a second save to the same path while one is in flight fails at once, naming the holder;
- ``latest`` means the latest committed checkpoint; ``prune`` removes older ones only once a newer
  one is committed.

Every error is a ``CheckpointError`` (an ``Exception``), raised on every rank, naming the path, the
rank(s) and what was expected and found. Collective: every rank of the default group calls these.
"""

import copy
import json
import os
import shutil
import socket
import threading
import uuid
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from ._engine import collectives as comm

MANIFEST = "fsdp1_manifest.json"
"""The commit marker: a checkpoint directory without it is incomplete."""
STAGING = ".partial-"
"""A save stages into ``<path>.partial-<id>``: never a checkpoint, whatever it holds."""

PathLike = Union[str, "os.PathLike[str]"]


class CheckpointError(Exception):
    """Any failure of ``save`` or ``load``; raised on every rank."""


class CheckpointIncomplete(CheckpointError):
    """The directory was never committed (a save died, or it is not an fsdp1 checkpoint)."""


class CheckpointCorrupted(CheckpointError):
    """A file differs from what the manifest recorded (size or checksum), or the manifest itself."""


class CheckpointNonFinite(CheckpointError):
    """``load(validate_finite=True)`` found an Inf or NaN in a loaded floating-point value."""


class CheckpointExists(CheckpointError):
    """``save`` to a path that already holds a committed checkpoint."""


class CheckpointBusy(CheckpointError):
    """Another save to the same path is in flight."""


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _describe(path: Path) -> Dict[str, int]:
    return {"bytes": path.stat().st_size, "crc32": _crc32(path)}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _manifest_checksum(files: Dict[str, Dict[str, int]]) -> int:
    return zlib.crc32(json.dumps(files, sort_keys=True).encode())


Problem = Optional[Tuple[type, str]]
"""None, or the error class a rank would raise and why."""


def _agree(problem: Problem, what: str, path: Path, group: Optional[Any] = None) -> None:
    """Raise on every rank if any rank has a problem: the first such rank's error class, naming every
    rank that had one and why."""
    reports = comm.all_gather_object(problem, group or comm.default_group())
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    if failed:
        by_message: Dict[str, List[int]] = {}
        for rank, (_, message) in failed:
            by_message.setdefault(message.removeprefix("fsdp1: "), []).append(rank)
        detail = "; ".join(f"rank {ranks[0]}: {message}" if len(ranks) == 1 else f"ranks {ranks}: {message}"
                           for message, ranks in by_message.items())
        raise failed[0][1][0](f"fsdp1: {what} '{path}' failed on rank(s) {[rank for rank, _ in failed]}: {detail}")


class _Lock:
    """``<path>.lock``, created exclusively by rank 0 for the length of a save, holding who took it.
    A lock left by a process of this host that is gone (a job killed mid-save, then restarted by
    torchrun) is taken over; one of another host cannot be checked, so it is refused."""

    def __init__(self, path: Path) -> None:
        self.file = path.with_name(path.name + ".lock")
        self.host = socket.gethostname()
        self.holder = f"host {self.host} pid {os.getpid()}"

    def acquire(self) -> Optional[str]:
        """None, or why the lock is not ours."""
        for _ in range(2):
            try:
                fd = os.open(self.file, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                try:
                    holder = self.file.read_text() or "unknown"
                except OSError:
                    holder = "unknown"
                if not self._left_by_a_dead_process(holder):
                    return (f"another save holds {self.file} ({holder}); wait for it, or delete the file if "
                            "that process is gone")
                self.file.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(self.holder)
            return None
        return f"{self.file} was taken again while a stale lock was being replaced"

    def _left_by_a_dead_process(self, holder: str) -> bool:
        host, _, pid = holder.removeprefix("host ").rpartition(" pid ")
        if host != self.host or not pid.isdigit():
            return False
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def release(self) -> None:
        self.file.unlink(missing_ok=True)


def is_committed(path: PathLike) -> bool:
    """A checkpoint's manifest is there, under a final name: a staging directory of a save that died
    after sealing it, before the rename, is not one."""
    return STAGING not in Path(path).name and (Path(path) / MANIFEST).is_file()


def save(state_dict: Dict[str, Any], path: PathLike) -> None:
    """Save ``state_dict`` (as ``torch.distributed.checkpoint.save`` takes it) as a committed checkpoint
    at ``path``, which must not hold one yet. Nothing appears at ``path`` unless every rank wrote its
    part: a save that fails or dies leaves at most a ``<path>.partial-*`` staging directory, which
    ``latest`` and ``load`` never take."""
    _save(state_dict, Path(path), comm.default_group())


def _save(state_dict: Dict[str, Any], path: Path, group: Any) -> None:
    comm.check_every_rank_calls(group, "fsdp1.checkpoint.save()")
    first_path = comm.broadcast_object_from_first(str(path), group)
    _agree(None if first_path == str(path) else (CheckpointError, f"given '{path}', rank 0 '{first_path}'"),
           "save to", path, group)
    rank = comm.group_rank(group)
    lock = _Lock(path)
    refusal: Problem = None
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        if is_committed(path):
            refusal = (CheckpointExists, "it already holds a committed checkpoint, which is never written into; save "
                                         "under a new name (and prune the old one once that is committed)")
        else:
            busy = lock.acquire()
            refusal = (CheckpointBusy, busy) if busy else None
    refusal, staging = comm.broadcast_object_from_first(
        (refusal, path.with_name(f"{path.name}{STAGING}{uuid.uuid4().hex[:12]}")), group)
    if refusal:
        raise refusal[0](f"fsdp1: cannot save to '{path}': {refusal[1]}.")
    try:
        _write(state_dict, path, staging, rank, group)
    finally:
        if rank == 0:
            lock.release()


def _write(state_dict: Dict[str, Any], path: Path, staging: Path, rank: int, group: Any) -> None:
    problem: Problem = None
    mine: Dict[str, Dict[str, int]] = {}
    try:
        dcp.save(state_dict, checkpoint_id=staging, process_group=group)
        mine = {f.name: _describe(f) for f in sorted(staging.glob(f"__{rank}_*")) if f.is_file()}
    except CheckpointException as error:  # a BaseException, which DCP raises on every rank
        problem = _own_failure(error, rank)
    except Exception as error:  # noqa: BLE001 - reported to every rank
        problem = (CheckpointError, f"{type(error).__name__}: {error}")
    reports = comm.all_gather_object((problem, mine), group)
    written = not any(report for report, _ in reports)
    if rank == 0:
        if written:
            problem = _commit(path, staging, {name: d for _, files in reports for name, d in files.items()})
        else:
            shutil.rmtree(staging, ignore_errors=True)
    _agree(problem, "save (nothing committed; an earlier checkpoint is untouched) to", path, group)


class AsyncSaver:
    """Saves in the background: ``save`` copies the state to CPU memory, returns,
    and a thread of this process runs ``save``'s protocol on a gloo group of the saver's own, so that
    its collectives never interleave with training's on the default group. One save at a time: the
    next ``save`` first waits for the one in flight. ``wait()`` finishes it and raises its error (on
    every rank, as ``save``'s); call it before the job ends. Create it on every rank (collective)."""

    def __init__(self) -> None:
        self._group = comm.new_gloo_group()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def save(self, state_dict: Dict[str, Any], path: PathLike) -> None:
        """Start saving ``state_dict`` at ``path`` as ``save`` would; later changes to the model or the
        optimizer do not reach the checkpoint."""
        self.wait()
        staged = _copied_to_cpu(state_dict)
        self._thread = threading.Thread(target=self._run, args=(staged, Path(path)), name="fsdp1-async-save",
                                        daemon=True)
        self._thread.start()

    def _run(self, staged: Dict[str, Any], path: Path) -> None:
        try:
            _save(staged, path, self._group)
        except BaseException as error:  # noqa: BLE001 - raised by wait() in the training thread
            self._error = error

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error


def _copied_to_cpu(tree: Any) -> Any:
    """``tree`` with every tensor copied to CPU memory (a DTensor keeps its mesh and placements, with a
    CPU copy of its local part), so the save reads a snapshot."""
    if isinstance(tree, dict):
        return {key: _copied_to_cpu(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_copied_to_cpu(value) for value in tree]
    if isinstance(tree, DTensor):
        local = tree.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(local, tree.device_mesh, tree.placements, run_check=False, shape=tree.shape,
                                  stride=tree.stride())
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    return copy.deepcopy(tree)


def _commit(path: Path, staging: Path, files: Dict[str, Dict[str, int]]) -> Problem:
    """Rank 0: seal the staging directory with the manifest of ``files``, then give it the
    checkpoint's name. None, or what went wrong (staging removed)."""
    try:
        _seal(staging, files)
        if path.exists():  # an uncommitted leftover of a save that died: never a checkpoint
            shutil.rmtree(path)
        os.replace(staging, path)
        _fsync_dir(path.parent)
        return None
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        return CheckpointError, f"committing: {type(error).__name__}: {error}"


def _seal(directory: Path, files: Dict[str, Dict[str, int]]) -> None:
    """Record ``files`` and ``.metadata`` in the manifest, written last (temporary file, fsync, rename)."""
    files = {**files, ".metadata": _describe(directory / ".metadata")}
    manifest = {"format": "fsdp1-checkpoint-1", "files": files, "checksum": _manifest_checksum(files)}
    temporary = directory / (MANIFEST + ".tmp")
    with open(temporary, "w") as f:
        json.dump(manifest, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, directory / MANIFEST)
    _fsync_dir(directory)


def seal_written_by_one_process(directory: PathLike) -> None:
    """Commit a checkpoint that one process wrote itself (``dcp.save(..., no_dist=True)``, as
    ``tools/checkpoint.py to-dcp`` does) by recording its files; give it its final name afterwards."""
    directory = Path(directory)
    _seal(directory, {f.name: _describe(f) for f in sorted(directory.glob("__*_*")) if f.is_file()})


def verify(path: PathLike) -> Dict[str, Dict[str, int]]:
    """The manifest's files of a committed checkpoint, after checking every file's size and CRC-32
    against it on this process alone (no process group needed). Raises ``CheckpointIncomplete`` or
    ``CheckpointCorrupted`` naming the file, what was recorded and what was found."""
    path = Path(path)
    files = _read_manifest(path)
    problem = _first_problem(path, sorted(files.items()))
    if problem:
        raise CheckpointCorrupted(f"fsdp1: checkpoint '{path}': {problem}")
    return files


def _first_problem(path: Path, files: List[Tuple[str, Dict[str, int]]]) -> Optional[str]:
    return next(filter(None, (_check_file(path, name, recorded) for name, recorded in files)), None)


def _read_manifest(path: Path) -> Dict[str, Dict[str, int]]:
    if not path.is_dir():
        raise CheckpointIncomplete(f"fsdp1: no checkpoint at '{path}' (no such directory).")
    if not is_committed(path):
        raise CheckpointIncomplete(
            f"fsdp1: '{path}' is not a committed checkpoint: it has no {MANIFEST}, which a save writes "
            "last, so that save never finished. Load an earlier one (fsdp1.checkpoint.latest skips this).")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        intact = manifest["checksum"] == _manifest_checksum(files)
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointCorrupted(f"fsdp1: checkpoint '{path}': its {MANIFEST} is unreadable ({error}).") from error
    if not intact:
        raise CheckpointCorrupted(f"fsdp1: checkpoint '{path}': its {MANIFEST} fails its own checksum.")
    return files


def _check_file(path: Path, name: str, recorded: Dict[str, int]) -> Optional[str]:
    file = path / name
    if not file.is_file():
        return f"file {name} is missing (recorded {recorded['bytes']} bytes)"
    found = file.stat().st_size
    if found != recorded["bytes"]:
        return f"file {name} has {found} bytes, the manifest recorded {recorded['bytes']}"
    crc = _crc32(file)
    if crc != recorded["crc32"]:
        return f"file {name} has CRC-32 {crc:08x}, the manifest recorded {recorded['crc32']:08x}: its content changed"
    return None


def load(state_dict: Dict[str, Any], path: PathLike, validate_finite: bool = False) -> None:
    """Fill ``state_dict`` (templates, as ``torch.distributed.checkpoint.load`` takes them) from the
    committed checkpoint at ``path``, on any number of ranks. Every file is checked against the
    manifest first (the ranks share the reading); any problem raises on every rank before a tensor
    is touched. ``validate_finite``: then every loaded floating-point value is checked, and an Inf or
    NaN raises ``CheckpointNonFinite`` on every rank naming the key, before the caller loads the
    values into a model (a checksum proves the bytes are those saved, not that they were sane)."""
    group = comm.default_group()
    comm.check_every_rank_calls(group, "fsdp1.checkpoint.load()")
    path = Path(path)
    rank, world_size = comm.group_rank(group), comm.group_size(group)
    problem: Problem = None
    try:
        found = _first_problem(path, sorted(_read_manifest(path).items())[rank::world_size])
        problem = (CheckpointCorrupted, found) if found else None
    except CheckpointError as error:
        problem = (type(error), str(error))
    _agree(problem, "checking (each rank a share of the files of) the checkpoint", path)
    try:
        dcp.load(state_dict, checkpoint_id=path)
    except CheckpointException as error:
        problem = _own_failure(error, rank)
    _agree(problem, "loading", path)
    if validate_finite:
        found = _first_non_finite(state_dict, "")
        _agree((CheckpointNonFinite, found) if found else None, "checking the values loaded from", path)


def _first_non_finite(tree: Dict[str, Any], prefix: str) -> Optional[str]:
    """The first key (dotted through nested dicts) whose floating-point value (this rank's part of a
    DTensor) is not all finite, described."""
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            found = _first_non_finite(value, name + ".")
            if found:
                return found
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            local = value.to_local() if isinstance(value, DTensor) else value
            bad = ~torch.isfinite(local)
            if bad.any():
                first = int(bad.flatten().nonzero()[0])
                return (f"'{name}' holds {int(bad.sum())} non-finite value(s), the first "
                        f"{local.flatten()[first].item()} at flat index {first} of this rank's part")
    return None


def _own_failure(error: CheckpointException, rank: int) -> Problem:
    """This rank's part of a DCP failure, which DCP raises on every rank with every rank's traceback:
    its own exception, or None, so that the error names only the ranks that failed."""
    failure = error.failures.get(rank)
    if failure is None:
        return None
    cause = failure[0]
    return CheckpointError, f"torch.distributed.checkpoint: {type(cause).__name__}: {cause}"


def committed(root: PathLike) -> List[Path]:
    """The committed checkpoints directly under ``root``, oldest first (by name: name them so that
    they sort, e.g. ``step_000100``)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and is_committed(p))


def latest(root: PathLike) -> Optional[Path]:
    """The last committed checkpoint under ``root`` by name, or None: a save that never committed is
    skipped."""
    found = committed(root)
    return found[-1] if found else None


def prune(root: PathLike, keep: int) -> List[Path]:
    """Remove all but the ``keep`` last committed checkpoints under ``root`` (rank 0 deletes; every
    rank calls it), and the staging directories of saves that died; returns what was removed."""
    if keep < 1:
        raise ValueError(f"fsdp1: prune(keep={keep}) would remove every checkpoint; keep at least 1.")
    group = comm.default_group()
    root = Path(root)
    removed: List[Path] = []
    problem: Problem = None
    if comm.group_rank(group) == 0 and root.is_dir():  # no root yet: nothing to prune, as latest() finds nothing
        try:
            old = committed(root)[:-keep]
            dead = [p for p in root.iterdir() if STAGING in p.name and not _Lock(_staged_target(p)).file.exists()]
            for victim in old + dead:
                shutil.rmtree(victim, ignore_errors=True)
                removed.append(victim)
        except OSError as error:
            problem = (CheckpointError, f"{type(error).__name__}: {error}")
    removed, problem = comm.broadcast_object_from_first((removed, problem), group)
    if problem:
        raise problem[0](f"fsdp1: pruning '{root}' failed on rank 0 (which deletes): {problem[1]}")
    return removed


def _staged_target(staging: Path) -> Path:
    return staging.with_name(staging.name.split(STAGING)[0])


__all__: Tuple[str, ...] = ("CheckpointError", "CheckpointIncomplete", "CheckpointCorrupted", "CheckpointExists",
                            "CheckpointBusy", "CheckpointNonFinite", "MANIFEST", "save", "load", "verify", "latest",
                            "committed", "prune", "is_committed", "seal_written_by_one_process", "AsyncSaver")
