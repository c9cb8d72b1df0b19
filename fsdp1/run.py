"""Run a training script written for torch's FSDP (FSDP1 or ``fully_shard``) on fsdp1, unedited.

    torchrun --nproc-per-node 2 -m fsdp1.run train.py --its own --arguments
    torchrun --nproc-per-node 2 -m fsdp1.run -m package.module --its own --arguments
    accelerate launch --config_file fsdp.yaml -m fsdp1.run train.py --its own --arguments

``use_as_torch_fsdp()`` is put in effect before the script is imported, so every name it or its
libraries (Accelerate, the Transformers ``Trainer``, Lightning, torch's pipeline schedules and
checkpoint helpers) take from ``torch.distributed.fsdp`` is fsdp1's; then the script runs as
``python train.py`` or ``python -m package.module`` would run it: as ``__main__``, with its own
``sys.argv`` and its directory first on ``sys.path``. The processes it starts (``mp.spawn``'s ranks,
a Lightning ``Trainer`` starting its own) get fsdp1 in torch's place too: see ``_children``.
"""

import importlib.util
import os
import runpy
import sys
from typing import List, Optional

from . import _children
from ._torch_alias import use_as_torch_fsdp

USAGE = """usage: python -m fsdp1.run SCRIPT [ARGS...]     (a file, or a folder or zip with __main__.py)
       python -m fsdp1.run -m MODULE [ARGS...]

Runs a script written for torch's FSDP with fsdp1 in torch's place (under torchrun, accelerate launch
or any launcher that runs `python -m`), without editing it."""


def main(argv: Optional[List[str]] = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--"]:
        args = args[1:]
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if args else sys.stderr)
        raise SystemExit(0 if args else 2)
    as_module = args[0] == "-m"
    if as_module and len(args) < 2:
        raise SystemExit(f"fsdp1.run: -m needs a module name.\n\n{USAGE}")
    target = args[1] if as_module else args[0]
    if not as_module and not os.path.exists(target):
        raise SystemExit(f"fsdp1.run: no script '{target}' (from {os.getcwd()}).\n\n{USAGE}")
    use_as_torch_fsdp()
    children = os.path.dirname(os.path.abspath(_children.__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [children, os.environ.get("PYTHONPATH")]))
    if as_module:
        sys.path[0] = os.getcwd()  # as `python -m` does
        if importlib.util.find_spec(target) is None:
            raise SystemExit(f"fsdp1.run: no module named '{target}' (from {os.getcwd()}).")
        sys.argv = [target, *args[2:]]  # runpy puts the module's path in sys.argv[0]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(target)  # as `python script.py` makes __file__ and sys.path[0]
        sys.argv = [target, *args[1:]]
        sys.path[0] = script if os.path.isdir(script) else os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
