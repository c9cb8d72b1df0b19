"""python -m fsdp1.plan: will a model fit on N devices of M GiB, and with which settings?

    python -m fsdp1.plan --preset llama-2-7b --world-size 8 --device-memory 40GiB --seq 4096
    python -m fsdp1.plan --config path/to/config.json --world-size 8 --device-memory 80GiB --api fully_shard
    python -m fsdp1.plan --model-type llama --set hidden_size=2048 num_hidden_layers=16 --world-size 4 --device-memory 24GiB
    python -m fsdp1.plan --factory mypackage.models:make_model --world-size 8 --device-memory 80GiB
    python -m fsdp1.plan --preset llama-3-8b --profile h100-sxm --nodes 2x8 --bf16

The model is a Transformers causal LM made from a config (a preset of public sizes, a config.json,
or a model type with settings; nothing is downloaded, Transformers must be installed), or whatever a
factory function returns, trained on ``--batch`` sequences of ``--seq`` tokens a rank with AdamW
(a factory's model is called on the token ids and returns logits, or an object with ``.logits``).
It prints the plan, every candidate measured and the code that applies the plan; ``--json`` writes
the same as data. The step cost is calibrated by a probe of this machine; ``--profile`` takes a GPU's
published rates instead (its memory too, unless ``--device-memory`` says otherwise), in nodes of
``--nodes NODESxGPUS`` (or ``--world-size`` ranks in nodes of 8) joined by ``--network``; ``--calibration`` reuses a probe's figures (the
``calibration`` entry of a ``--json`` file written where the job will run). A CUDA job planned
without CUDA and without either assumes the h100-sxm profile, and says so.
"""

import argparse
import importlib
import json
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import nn
from torch.nn import functional as F

from .._planner.cost import Calibration
from .._planner.plan import NoPlanFits, plan
from .._planner.profiles import NETWORKS, PROFILES, profile

PRESETS: Dict[str, Dict[str, Any]] = {
    "gpt2-xl": dict(model_type="gpt2", n_embd=1600, n_layer=48, n_head=25, vocab_size=50257, n_positions=1024),
    "llama-2-7b": dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096),
    "llama-2-13b": dict(model_type="llama", hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                        num_attention_heads=40, num_key_value_heads=40, vocab_size=32000, max_position_embeddings=4096),
    "llama-3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192),
    "llama-2-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096),
}
"""Public model sizes (their published configs' shapes), by name."""


def main(argv: Optional[List[str]] = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    build, loss, positions = _model(args, parser)
    seq = args.seq or min(2048, positions or 2048)
    if positions and seq > positions:
        parser.error(f"--seq {seq} is longer than the model's {positions} positions")
    tokens = torch.zeros(args.batch, seq, dtype=torch.long)
    world_size, calibration, device_memory = _hardware(args, parser)
    try:
        result = plan(build, tokens, loss, world_size=world_size, device_memory=device_memory, api=args.api,
                      mesh_shape=_mesh_shape(args.mesh, parser), device_type=args.device_type,
                      param_dtypes=(None, torch.bfloat16) if args.bf16 else (None,), allow_offload=not args.no_offload,
                      host_memory=args.host_memory, headroom=args.headroom, calibration=calibration)
    except NoPlanFits as error:
        raise SystemExit(str(error))
    print(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.as_dict(), f, indent=1)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fsdp1.plan", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 1)[1])
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--preset", choices=sorted(PRESETS), help="a public model size")
    model.add_argument("--config", help="a Transformers config.json (or the folder holding it)")
    model.add_argument("--model-type", help="a Transformers model type (llama, gpt2, ...), sized by --set")
    model.add_argument("--factory", help="module:function returning the model (built under the meta device)")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="config settings (with --model-type, --preset or --config)")
    ranks = parser.add_mutually_exclusive_group(required=True)
    ranks.add_argument("--world-size", type=int, help="ranks of the job")
    ranks.add_argument("--nodes", help="NODESxGPUS: the job's nodes and GPUs a node, e.g. 2x8 (with --profile)")
    parser.add_argument("--device-memory", help="memory a device, e.g. 24GiB, 80GB (default: the --profile GPU's)")
    parser.add_argument("--profile", choices=sorted(PROFILES), help="cost the step at this GPU's published rates")
    parser.add_argument("--network", choices=sorted(NETWORKS), help="between the nodes (default: the profile GPU's usual)")
    parser.add_argument("--api", choices=["FullyShardedDataParallel", "fully_shard"], default="FullyShardedDataParallel")
    parser.add_argument("--mesh", help="hybrid sharding: REPLICASxSHARD, e.g. 2x4")
    parser.add_argument("--batch", type=int, default=1, help="sequences a rank and step (default 1)")
    parser.add_argument("--seq", type=int, help="tokens a sequence (default: 2048, or the model's positions if fewer)")
    parser.add_argument("--bf16", action="store_true", help="let the plan gather and compute in bfloat16 (fp32 reduction)")
    parser.add_argument("--no-offload", action="store_true", help="never offload to the CPU")
    parser.add_argument("--host-memory", help="what offload may keep in host memory a rank, e.g. 64GiB (default: unbounded)")
    parser.add_argument("--device-type", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--headroom", type=float, default=0.1, help="share of device memory left free (default 0.1)")
    parser.add_argument("--calibration", help="a --json file whose calibration to reuse instead of probing")
    parser.add_argument("--json", help="write the plan as JSON here")
    return parser


def _model(args: argparse.Namespace, parser: argparse.ArgumentParser
           ) -> Tuple[Callable[[], nn.Module], Callable[[nn.Module, torch.Tensor], torch.Tensor], Optional[int]]:
    """The model's factory, its loss, and how many positions it embeds (None when unknown)."""
    if args.factory:
        module_name, colon, function = args.factory.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), function) if colon else None
        except (ImportError, AttributeError) as error:
            parser.error(f"--factory {args.factory}: {error}")
        if factory is None:
            parser.error(f"--factory {args.factory}: pass module:function, e.g. mypackage.models:make_model")
        return factory, _logits_loss, None
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(_setting(item) for item in args.set)
    if args.config:
        config = AutoConfig.from_pretrained(args.config, **settings)
    else:
        preset = dict(PRESETS[args.preset]) if args.preset else {"model_type": args.model_type}
        config = AutoConfig.for_model(preset.pop("model_type"), **{**preset, **settings})
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return (lambda: AutoModelForCausalLM.from_config(config)), _causal_lm_loss, positions


def _causal_lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss


def _logits_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    output = model(tokens)
    logits = output if isinstance(output, torch.Tensor) else output.logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def _setting(item: str) -> Tuple[str, Any]:
    key, _, value = item.partition("=")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _mesh_shape(mesh: Optional[str], parser: argparse.ArgumentParser) -> Optional[Tuple[int, int]]:
    return None if mesh is None else _pair(mesh, "--mesh", "REPLICASxSHARD, e.g. 2x4", parser)


def _hardware(args: argparse.Namespace, parser: argparse.ArgumentParser
              ) -> Tuple[int, Optional[Calibration], Union[int, str]]:
    """The world size, the calibration (None: probe this machine) and the memory a device."""
    if args.profile is None:
        for flag, value in (("--nodes", args.nodes), ("--network", args.network)):
            if value is not None:
                parser.error(f"{flag} sets the node shape of a --profile; pass --profile NAME too")
        if args.device_memory is None:
            parser.error("--device-memory is required without --profile")
        return args.world_size, _calibration(args.calibration, parser), args.device_memory
    if args.calibration is not None:
        parser.error("--profile and --calibration both set the step's rates; pass one")
    memory = args.device_memory or PROFILES[args.profile].memory
    if args.nodes is None:  # nodes of eight, as the DGX and HGX systems have
        return args.world_size, profile(args.profile, network=args.network), memory
    nodes, gpus = _pair(args.nodes, "--nodes", "NODESxGPUS, e.g. 2x8", parser)
    return nodes * gpus, profile(args.profile, gpus_per_node=gpus, network=args.network), memory


def _pair(text: str, flag: str, form: str, parser: argparse.ArgumentParser) -> Tuple[int, int]:
    first, _, second = text.lower().partition("x")
    if not (first.isdigit() and second.isdigit() and int(first) > 0 and int(second) > 0):
        parser.error(f"{flag} {text}: pass {form}")
    return int(first), int(second)


def _calibration(path: Optional[str], parser: argparse.ArgumentParser) -> Optional[Calibration]:
    if path is None:
        return None
    try:
        with open(path) as f:
            return Calibration(**json.load(f)["calibration"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        parser.error(f"--calibration {path}: {error!r}; pass a file written by --json")


if __name__ == "__main__":
    main()
