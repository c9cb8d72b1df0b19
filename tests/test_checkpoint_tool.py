"""Tests tools/checkpoint.py against the state dict a checkpoint was saved from.

One process, no rank pool: the sharded checkpoints are saved (and loaded) by two ranks that are threads
of this process. The commands run in process through ``main``; the path errors also run as the command
line with torch unimportable, since they must fail before its import (seconds).
"""

import importlib.util
import json
import shutil
import subprocess
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

TOOL = Path(__file__).resolve().parents[1] / "tools" / "checkpoint.py"
_spec = importlib.util.spec_from_file_location("checkpoint_tool", TOOL)
checkpoint_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checkpoint_tool)

WORLD_SIZE = 2


class TiedLM(nn.Module):
    """Odd sizes, a LayerNorm, buffers of two dtypes, and an output head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 10)
        self.body = nn.Sequential(nn.Linear(10, 13), nn.LayerNorm(13), nn.Linear(13, 10))
        self.head = nn.Linear(10, 37, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("positions", torch.arange(7))
        self.register_buffer("scale", torch.ones(3, dtype=torch.bfloat16))


def make_model(seed: int) -> TiedLM:
    """A model whose every entry, buffers and LayerNorm included, differs from another seed's."""
    torch.manual_seed(seed)
    model = TiedLM()
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.normal_() if tensor.is_floating_point() else tensor.random_(1000)
    return model


def on_ranks(fn: Callable[[DeviceMesh], Any]) -> list[Any]:
    """``fn(mesh)`` on each of ``WORLD_SIZE`` ranks, which are threads on torch's threaded process group
    (two spawned processes would spend seconds each importing torch); returns the ranks' results."""
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    results, failures, store = [None] * WORLD_SIZE, [], dist.HashStore()

    def run_rank(rank: int) -> None:
        try:
            dist.init_process_group("threaded", rank=rank, world_size=WORLD_SIZE, store=store)
            results[rank] = fn(init_device_mesh("cpu", (WORLD_SIZE,)))
            dist.destroy_process_group()
        except BaseException as error:
            failures.append(error)
            ProcessLocalGroup.exception_handle(error)  # wakes a peer waiting in a collective

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    try:
        threads = [threading.Thread(target=run_rank, args=(rank,)) for rank in range(WORLD_SIZE)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        if any(thread.is_alive() for thread in threads):
            raise TimeoutError("a rank thread is still running after 60 s")
    finally:
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if failures:
        raise failures[0]
    return results


def shard(state_dict: dict[str, torch.Tensor], mesh: DeviceMesh) -> dict[str, torch.Tensor]:
    """Every tensor as a DTensor sharded on dim 0, as a SHARDED_STATE_DICT holds it (37 rows: 19 + 18)."""
    return {fqn: distribute_tensor(tensor, mesh, [Shard(0)], src_data_rank=None) for fqn, tensor in state_dict.items()}


def save_single_process(state_dict: dict[str, Any], path: Path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=checkpoint_tool.NO_PROCESS_GROUP_WARNING)
        dcp.save(state_dict, checkpoint_id=path, no_dist=True)


def load_single_process(state_dict: dict[str, Any], path: Path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=checkpoint_tool.NO_PROCESS_GROUP_WARNING)
        dcp.load(state_dict, checkpoint_id=path, no_dist=True)


@pytest.fixture(scope="module")
def truth() -> dict[str, torch.Tensor]:
    return make_model(0).state_dict()


@pytest.fixture(scope="module")
def sharded(truth, tmp_path_factory) -> Path:
    """A checkpoint of ``truth`` saved by two ranks, each writing its half of every tensor."""
    path = tmp_path_factory.mktemp("sharded")
    on_ranks(lambda mesh: dcp.save(shard(truth, mesh), checkpoint_id=path))
    return path


@pytest.fixture(scope="module")
def nested(truth, tmp_path_factory) -> Path:
    """A checkpoint of a model next to non-tensor entries, as a training loop saves it."""
    path = tmp_path_factory.mktemp("nested")
    save_single_process({"model": truth, "step": 7, "optim": {"lr": 0.1}}, path)
    return path


def run_main(capsys, *argv: Any) -> tuple[int, str, str]:
    code = checkpoint_tool.main([str(arg) for arg in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_bitwise_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for fqn, tensor in expected.items():
        assert actual[fqn].dtype == tensor.dtype, fqn
        assert torch.equal(actual[fqn], tensor), fqn


def assert_loads_strictly(state_dict: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> None:
    model = make_model(1)
    assert all(not torch.equal(model.state_dict()[fqn], tensor) for fqn, tensor in truth.items())
    model.load_state_dict(state_dict, strict=True)
    assert_bitwise_equal(model.state_dict(), truth)
    assert model.head.weight is model.embed.weight


def test_inspect_lists_every_entry_with_its_shape_dtype_bytes_and_one_chunk_per_rank(sharded, truth, capsys):
    expected = [{"key": fqn, "type": "tensor", "shape": list(tensor.shape), "dtype": str(tensor.dtype)[len("torch."):],
                 "nbytes": tensor.numel() * tensor.element_size(), "chunks": WORLD_SIZE}
                for fqn, tensor in sorted(truth.items())]
    nbytes = sum(entry["nbytes"] for entry in expected)
    code, out, _ = run_main(capsys, "inspect", sharded, "--json")
    assert code == 0
    assert json.loads(out) == {"entries": expected,
                               "total": {"entries": len(truth), "tensors": len(truth), "objects": 0, "nbytes": nbytes}}

    code, out, _ = run_main(capsys, "inspect", sharded)
    header, *rows, total = out.splitlines()
    assert header.split() == ["key", "shape", "dtype", "bytes", "chunks"]
    assert [row.split()[0] for row in rows] == [entry["key"] for entry in expected]
    for row, entry in zip(rows, expected):
        assert str(tuple(entry["shape"])) in row
        assert f" {entry['dtype']} " in row
        assert row.split()[-2:] == [str(entry["nbytes"]), str(WORLD_SIZE)]
    count = len(truth)
    assert total == f"total: entries {count} (tensors {count}, objects 0), {nbytes} bytes of tensors (0.00 MiB)"


def test_inspect_lists_non_tensor_entries_as_objects(nested, truth, capsys):
    code, out, _ = run_main(capsys, "inspect", nested, "--json")
    listing = json.loads(out)
    assert {"key": "step", "type": "object"} in listing["entries"]
    assert {"key": "optim.lr", "type": "object"} in listing["entries"]
    assert listing["total"]["objects"] == 2
    assert listing["total"]["tensors"] == len(truth)


@pytest.mark.parametrize("suffix, read", [(".pt", lambda path: torch.load(path, weights_only=True)),
                                          (".safetensors", load_file)])
def test_consolidate_is_bitwise_equal_and_loads_strictly_with_both_tied_keys(sharded, truth, tmp_path, suffix, read,
                                                                             capsys):
    out = tmp_path / f"model{suffix}"
    code, _, _ = run_main(capsys, "consolidate", sharded, out)
    assert code == 0
    state_dict = read(out)
    assert_bitwise_equal(state_dict, truth)
    assert state_dict["head.weight"].data_ptr() != state_dict["embed.weight"].data_ptr()
    assert_loads_strictly(state_dict, truth)
    assert sorted(path.name for path in tmp_path.iterdir()) == [out.name]


def test_consolidate_safetensors_has_the_header_hugging_face_loaders_check(sharded, tmp_path, capsys):
    out = tmp_path / "model.safetensors"
    run_main(capsys, "consolidate", sharded, out)
    with safe_open(out, framework="pt") as file:
        assert file.metadata() == {"format": "pt"}


def test_consolidate_pt_keeps_the_nesting_that_was_saved(nested, truth, tmp_path, capsys):
    out = tmp_path / "all.pt"
    assert run_main(capsys, "consolidate", nested, out)[0] == 0
    loaded = torch.load(out, weights_only=True)
    assert sorted(loaded) == ["model", "optim", "step"]
    assert loaded["step"] == 7
    assert loaded["optim"] == {"lr": 0.1}
    assert_bitwise_equal(loaded["model"], truth)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_consolidate_prefix_keeps_and_strips_the_model_keys(nested, truth, tmp_path, suffix, capsys):
    out = tmp_path / f"model{suffix}"
    assert run_main(capsys, "consolidate", nested, out, "--prefix", "model.")[0] == 0
    state_dict = load_file(out) if suffix == ".safetensors" else torch.load(out, weights_only=True)
    assert_loads_strictly(state_dict, truth)


def test_consolidate_prefix_keeps_non_tensor_entries_in_a_pt_file(nested, tmp_path, capsys):
    out = tmp_path / "optim.pt"
    assert run_main(capsys, "consolidate", nested, out, "--prefix", "optim.")[0] == 0
    assert torch.load(out, weights_only=True) == {"lr": 0.1}


def test_consolidate_prefix_reads_a_checkpoint_saved_without_flattening(truth, tmp_path, capsys):
    """Such a checkpoint has no planner_data, on which torch's _EmptyStateDictLoadPlanner(keys=...) fails."""
    directory, out = tmp_path / "ckpt", tmp_path / "body.pt"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=checkpoint_tool.NO_PROCESS_GROUP_WARNING)
        dcp.save({**truth, "step": 7}, checkpoint_id=directory, no_dist=True,
                 planner=DefaultSavePlanner(flatten_state_dict=False))
    assert run_main(capsys, "consolidate", directory, out, "--prefix", "body.")[0] == 0
    assert_bitwise_equal(torch.load(out, weights_only=True),
                         {fqn[len("body."):]: tensor for fqn, tensor in truth.items() if fqn.startswith("body.")})


def test_consolidate_safetensors_refuses_non_tensor_entries_by_name(nested, tmp_path, capsys):
    out = tmp_path / "all.safetensors"
    code, _, err = run_main(capsys, "consolidate", nested, out)
    assert code == 1
    assert err.strip() == (f"checkpoint.py: error: {nested}: entries optim.lr, step are not tensors, and .safetensors "
                           "holds tensors only; keep tensors with --prefix (e.g. --prefix model.) or write a .pt file")
    assert list(tmp_path.iterdir()) == []


def test_consolidate_prefix_that_matches_nothing_is_an_error(nested, tmp_path, capsys):
    code, _, err = run_main(capsys, "consolidate", nested, tmp_path / "x.pt", "--prefix", "modle.")
    assert code == 1
    assert f"{nested}: no key starts with 'modle.'" in err
    assert list(tmp_path.iterdir()) == []


def test_consolidate_crash_leaves_the_old_output_and_no_partial_file(sharded, tmp_path, monkeypatch, capsys):
    out = tmp_path / "model.pt"
    out.write_bytes(b"previous")

    def crash_midway(obj: Any, path: Path) -> None:
        Path(path).write_bytes(b"half of a state dict")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash_midway)
    with pytest.raises(OSError, match="disk full"):
        checkpoint_tool.main(["consolidate", str(sharded), str(out), "--force"])
    assert out.read_bytes() == b"previous"
    assert list(tmp_path.iterdir()) == [out]


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_to_dcp_loads_bitwise_equal_in_one_process_and_sharded_on_two_ranks(truth, tmp_path, suffix, capsys):
    source = tmp_path / f"model{suffix}"
    if suffix == ".pt":
        assert truth["head.weight"].data_ptr() == truth["embed.weight"].data_ptr()  # torch.save keeps the tie
        torch.save(truth, source)
    else:
        save_file({fqn: tensor.clone() for fqn, tensor in truth.items()}, source)  # it refuses shared storage
    directory = tmp_path / "ckpt"
    assert run_main(capsys, "to-dcp", source, directory)[0] == 0

    state_dict = make_model(1).state_dict()
    load_single_process(state_dict, directory)
    assert_bitwise_equal(state_dict, truth)

    def load_shards(mesh: DeviceMesh) -> dict[str, torch.Tensor]:
        shards = shard({fqn: torch.zeros_like(tensor) for fqn, tensor in truth.items()}, mesh)
        dcp.load(shards, checkpoint_id=directory)
        return {fqn: dtensor.to_local() for fqn, dtensor in shards.items()}

    for rank, local in enumerate(on_ranks(load_shards)):
        assert_bitwise_equal(local, {fqn: tensor.chunk(WORLD_SIZE)[rank] for fqn, tensor in truth.items()})


def test_to_dcp_force_replaces_the_whole_directory(truth, tmp_path, capsys):
    source, directory = tmp_path / "model.pt", tmp_path / "ckpt"
    torch.save(truth, source)
    save_single_process({"stale": torch.ones(2)}, directory)
    (directory / "notes.txt").write_text("old")
    assert run_main(capsys, "to-dcp", source, directory, "--force")[0] == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt", "model.pt"]
    assert not (directory / "notes.txt").exists()
    state_dict = {fqn: torch.empty_like(tensor) for fqn, tensor in truth.items()}
    load_single_process(state_dict, directory)
    assert_bitwise_equal(state_dict, truth)


@pytest.mark.parametrize("content, message", [
    (b"not a checkpoint", "torch.load(weights_only=True) cannot read it"),
    ({"model": nn.Linear(2, 2)}, "torch.load(weights_only=True) cannot read it"),
    (torch.ones(3), "holds a Tensor, not a state dict"),
])
def test_to_dcp_refuses_files_that_are_not_state_dicts(tmp_path, content, message, capsys):
    source = tmp_path / "model.pt"
    source.write_bytes(content) if isinstance(content, bytes) else torch.save(content, source)
    code, _, err = run_main(capsys, "to-dcp", source, tmp_path / "ckpt")
    assert code == 1
    assert f"{source}: " in err
    assert message in err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model.pt"]


@pytest.mark.parametrize("prefix", [(), ("--prefix", "embed.")])
def test_consolidate_missing_shard_file_is_an_error_naming_it(sharded, tmp_path, prefix, capsys):
    directory, out = tmp_path / "ckpt", tmp_path / "model.pt"
    shutil.copytree(sharded, directory)
    (directory / "__1_0.distcp").unlink()
    code, _, err = run_main(capsys, "consolidate", directory, out, *prefix)
    assert code == 1
    assert f"{directory}: a data file is missing or damaged (FileNotFoundError: " in err
    assert str(directory / "__1_0.distcp") in err
    assert err.count("\n") == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt"]


def test_to_dcp_output_is_a_committed_fsdp1_checkpoint_whose_damage_inspect_names(truth, tmp_path, capsys):
    """to-dcp seals its output with fsdp1.checkpoint's manifest; a file changed afterwards is named."""
    from fsdp1 import checkpoint

    source, directory = tmp_path / "model.pt", tmp_path / "ckpt"
    torch.save(truth, source)
    assert run_main(capsys, "to-dcp", source, directory)[0] == 0
    assert checkpoint.is_committed(directory)
    assert ".metadata" in checkpoint.verify(directory)
    data = bytearray((directory / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 1
    (directory / "__0_0.distcp").write_bytes(bytes(data))
    code, _, err = run_main(capsys, "inspect", directory)
    assert code == 1
    assert "file __0_0.distcp has CRC-32" in err
    assert "the manifest recorded" in err


def test_damaged_metadata_is_an_error_naming_it(tmp_path, capsys):
    (tmp_path / ".metadata").write_bytes(b"garbage")
    code, _, err = run_main(capsys, "inspect", tmp_path)
    assert code == 1
    assert f"{tmp_path / '.metadata'}: cannot be read" in err


def run_cli(*argv: Any, hidden: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``python tools/checkpoint.py ARGV``, with the ``hidden`` packages made unimportable."""
    hide = (f"import runpy, sys; sys.modules.update(dict.fromkeys({hidden!r})); sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    python = [sys.executable, "-c", hide] if hidden else [sys.executable]
    return subprocess.run([*python, str(TOOL), *map(str, argv)], capture_output=True, text=True, timeout=60)


def assert_one_line_error(result: subprocess.CompletedProcess, *parts: str) -> None:
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("checkpoint.py: error: "), result.stderr
    assert all(part in result.stderr for part in parts), result.stderr


def test_cli_errors_name_the_path_and_the_fix_before_importing_torch(sharded, tmp_path):
    missing, empty, out = tmp_path / "missing", tmp_path / "empty", tmp_path / "model.pt"
    empty.mkdir()
    out.write_bytes(b"keep")
    cases = [(("inspect", missing), f"{missing}: no such directory"),
             (("inspect", empty), f"{empty}: no .metadata file"),
             (("consolidate", sharded, out), f"{out}: already exists; pass --force"),
             (("consolidate", sharded, missing / "model.pt"), f"{missing}: no such directory"),
             (("consolidate", sharded, empty), f"{empty}: is a directory"),
             (("to-dcp", missing / "model.pt", empty), f"{missing / 'model.pt'}: no such file"),
             (("to-dcp", out, sharded), f"{sharded}: already exists; pass --force")]
    with ThreadPoolExecutor(len(cases)) as pool:  # each is a Python start-up: run them side by side
        results = list(pool.map(lambda argv: run_cli(*argv, hidden=("torch",)), [argv for argv, _ in cases]))
    for result, (_, message) in zip(results, cases):
        assert_one_line_error(result, message)
    assert_one_line_error(run_cli("consolidate", sharded, tmp_path / "model.safetensors", hidden=("safetensors",)),
                          "model.safetensors: .safetensors files need the safetensors package; pip install safetensors")
    assert out.read_bytes() == b"keep"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["empty", "model.pt"]


def test_cli_usage_error_exits_nonzero():
    result = run_cli("consolidate")
    assert result.returncode == 2
    assert "OUT" in result.stderr
