"""The benchmark, the memory estimator and the checkpoint CLI: run from the repository root as
``python -m tools.NAME`` (``tools/checkpoint.py`` also runs as a plain script)."""
