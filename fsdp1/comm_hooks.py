"""torch's default FSDP1 communication hooks at a public path (torch keeps its own under
``torch.distributed.algorithms._comm_hooks.default_hooks``); they belong to the FSDP1 front, which
alone registers comm hooks."""

from ._wrapper.comm_hooks import *  # noqa: F403 - the hooks and their states, by torch's names
from ._wrapper.comm_hooks import __all__  # noqa: F401 - this module's names are the front's
