"""The migration pair: ``train_ddp.py`` and ``train_fsdp1.py``, run as modules from the repository root."""
