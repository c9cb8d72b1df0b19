"""The torch releases fsdp1 is tested on, and the one warning at import on any other.

fsdp1 reproduces torch's FSDP behaviour and reaches torch's public primitives (DTensor, DCP,
collectives, autograd hooks) whose details move between releases; a release outside this range may
work, but nothing here has checked it.
"""

import warnings
from typing import Tuple

import torch

TESTED_TORCH = ((2, 13), (2, 15))
"""The first and last torch releases (major, minor) the whole suite ran on."""


def release(version: str) -> Tuple[int, int]:
    """(major, minor) of a torch version string such as ``2.13.0+cpu``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def warn_if_untested(version: str = torch.__version__) -> None:
    first, last = TESTED_TORCH
    if not first <= release(version) <= last:
        tested = ".".join(map(str, first)) if first == last else f"{first[0]}.{first[1]} to {last[0]}.{last[1]}"
        warnings.warn(
            f"fsdp1 is tested on torch {tested}; this is torch {version}. It may work, but its numbers have "
            f"not been checked against torch's FSDP on this release: install torch {tested} to be sure.",
            stacklevel=3,
        )


FULLY_SHARD_FOLLOWS_GRAD_DTYPE = release(torch.__version__) >= (2, 15)
"""From torch 2.15 on, ``fully_shard``'s gradients follow each parameter's ``grad_dtype``: with
``param_dtype`` set and ``reduce_dtype=None`` they reduce in the parameter's own dtype (in ``param_dtype``
before), and the unsharded parameters add up their gradients in the reduction's dtype. A documented
change of torch's, not a fix: fsdp1 follows the release it runs on, whose documentation its users
read. FSDP1 keeps ``param_dtype``."""
