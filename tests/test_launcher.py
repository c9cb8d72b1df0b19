"""Tests ``python -m fsdp1.run``: scripts written for torch's FSDP, run unedited under a launcher with
fsdp1 in torch's place, train with fsdp1's classes and give torch's losses bit for bit: a Transformers
``Trainer`` script with its ``--fsdp`` options, an Accelerate loop under ``accelerate launch`` with a
config of ``fsdp_version: 2``, and a Lightning ``Trainer`` with ``FSDPStrategy`` and with
``ModelParallelStrategy``, and torch's FSDP tutorial, whose script spawns its own ranks. Accelerate
and Lightning run FSDP only on accelerators; on this CPU machine ``tests/launcher/cpu_fsdp`` lifts
those gates for the torch and the fsdp1 runs alike."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "launcher"

pytest.importorskip("accelerate")
pytest.importorskip("lightning")
pytest.importorskip("transformers")


def _start(folder, launch, script, *args, fsdp1=True, env=None):
    """``launch`` (a launcher's command) starting ``script`` with ``args`` in ``folder``, through
    ``-m fsdp1.run`` when ``fsdp1``, with ``env`` added to the environment."""
    folder.mkdir()
    env = {**os.environ, **(env or {}), "RECORD_TO": str(folder / "record.json"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(SCRIPTS / "cpu_fsdp"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [*launch, *(["-m", "fsdp1.run"] if fsdp1 else []), str(SCRIPTS / script), *args]
    return subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run_both(tmp_path, script, ours, theirs):
    """fsdp1's run and torch's of ``script`` at once (each mostly imports its clients), each in a folder
    of its own; ``ours`` and ``theirs``: (launch, args, env). What each script recorded."""
    started = [_start(tmp_path / name, launch, script, *args, fsdp1=name == "fsdp1", env=env)
               for name, (launch, args, env) in (("fsdp1", ours), ("torch", theirs))]
    try:
        outputs = [run.communicate(timeout=300) for run in started]
    finally:
        for run in started:
            run.kill()
    for run, (out, err) in zip(started, outputs):
        assert run.returncode == 0, out[-3000:] + err[-6000:]
    return [json.loads((tmp_path / name / "record.json").read_text()) for name in ("fsdp1", "torch")]


def _torchrun():
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


TRAINER_ARGS = ["--use_cpu", "--max_steps", "3", "--per_device_train_batch_size", "2", "--learning_rate", "1e-2",
                "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true",
                "--fsdp", "full_shard auto_wrap", "--fsdp_config", '{"transformer_layer_cls_to_wrap": ["GPT2Block"]}']


def test_a_transformers_trainer_script_with_its_fsdp_options(tmp_path):
    args = ["--output_dir", "out", *TRAINER_ARGS]
    ours, theirs = _run_both(tmp_path, "trainer_train.py", (_torchrun(), args, None), (_torchrun(), args, None))
    assert ours["engines"] == ["fsdp1:FSDPModule"]  # Transformers 5 shards with fully_shard by default
    assert theirs["engines"] == ["torch:FSDPModule"]
    assert len(ours["losses"]) == 3 and ours["losses"] == theirs["losses"]


def test_an_accelerate_script_under_an_fsdp_version_2_config(tmp_path):
    def launch():
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(SCRIPTS / "fsdp2.yaml"),
                "--main_process_port", str(_free_port())]

    ours, theirs = _run_both(tmp_path, "accelerate_train.py", (launch(), [], None), (launch(), [], None))
    assert ours["engines"] == ["fsdp1:FSDPModule"]
    assert theirs["engines"] == ["torch:FSDPModule"]
    assert len(ours["losses"]) == 4 and ours["losses"] == theirs["losses"]


def test_a_lightning_trainer_with_fsdp_strategy_and_with_model_parallel_strategy(tmp_path):
    """torch's FSDP1 cannot run under Lightning on the CPU (Lightning gives it no device, and it asks
    for an accelerator), so ``FSDPStrategy`` is held to torch's ``fully_shard`` under
    ``ModelParallelStrategy`` on the same model and data (Lightning's DDP gives the same losses too).
    The script trains with each strategy it is given in turn."""
    ours, theirs = _run_both(tmp_path, "lightning_train.py", (_torchrun(), ["fsdp", "model_parallel"], None),
                             (_torchrun(), ["model_parallel"], None))
    assert ours["engines"] == ["fsdp1:FSDPModule", "fsdp1:FullyShardedDataParallel"]
    assert theirs["engines"] == ["torch:FSDPModule"]
    losses = theirs["losses"]["model_parallel"]
    assert len(losses) == 4 and ours["losses"] == {"fsdp": losses, "model_parallel": losses}


def test_ranks_the_script_spawns_itself_train_on_fsdp1(tmp_path):
    """torch's FSDP tutorial starts its ranks with ``mp.spawn``: fresh interpreters, which the
    launcher reaches through their PYTHONPATH (they trained on torch's FSDP, silently)."""
    ours, theirs = _run_both(tmp_path, "spawn_train.py", ([sys.executable], [], {"MASTER_PORT": str(_free_port())}),
                             ([sys.executable], [], {"MASTER_PORT": str(_free_port())}))
    assert ours["engines"] == ["fsdp1:FullyShardedDataParallel"]
    assert theirs["engines"] == ["torch:FullyShardedDataParallel"]
    assert len(ours["losses"]) == 3 and ours["losses"] == theirs["losses"]


def _free_port():
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_module_runs_as_python_dash_m_runs_it(tmp_path):
    """And a script as ``python`` runs one: an absolute ``__file__``, a folder's ``__main__.py``, its
    exit status."""
    (tmp_path / "which_fsdp.py").write_text(
        "import sys\nimport torch.distributed.fsdp as fsdp\n"
        "print(fsdp.FullyShardedDataParallel.__module__, fsdp.fully_shard.__module__, sys.argv, __name__)\n")
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__main__.py").write_text("import sys\nprint(__file__)\nsys.exit(3)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    calls = [["-m", "which_fsdp", "--lr", "3"], ["app"], ["-m", "no_such_module"]]
    started = [subprocess.Popen([sys.executable, "-m", "fsdp1.run", *call], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for call in calls]  # at once: each mostly imports
    try:
        (module, module_err), (folder, _), (_, missing) = [run.communicate(timeout=120) for run in started]
    finally:
        for run in started:
            run.kill()
    assert started[0].returncode == 0, module_err
    assert module.split()[:2] == ["fsdp1._wrapper.fully_sharded_data_parallel", "fsdp1._fully_shard.fully_shard"]
    assert "'--lr', '3']" in module and module.rstrip().endswith("__main__")
    assert started[1].returncode == 3 and folder.strip() == str(tmp_path / "app" / "__main__.py")
    assert started[2].returncode == 1 and missing.strip() == f"fsdp1.run: no module named 'no_such_module' (from {tmp_path})."


@pytest.mark.parametrize("args, code, says", [([], 2, "usage: python -m fsdp1.run SCRIPT"),
                                              (["missing.py"], None, "no script 'missing.py'"),
                                              (["-m"], None, "-m needs a module name")])
def test_bad_calls_say_how(args, code, says, capsys):
    """Refused before the launcher changes anything of this process (torch's names, the path)."""
    from fsdp1.run import main

    with pytest.raises(SystemExit) as exited:
        main(args)
    message = exited.value.code if code is None else capsys.readouterr().err
    assert code is None or exited.value.code == code
    assert says in message
