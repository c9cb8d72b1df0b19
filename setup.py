from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="fsdp1",
    version="0.5.0",
    description="A standalone re-implementation of PyTorch's classic FullyShardedDataParallel (FSDP1)",
    long_description=Path(__file__).with_name("README.md").read_text(),
    long_description_content_type="text/markdown",
    license="BSD-3-Clause",
    packages=find_packages(include=["fsdp1", "fsdp1.*"]),
    python_requires=">=3.10",
    # The whole suite passes on torch 2.13, 2.14 and 2.15 (fsdp1._torch_version.TESTED_TORCH, which warns at
    # import on any other release). Only the lower bound is required: a cap would make pip replace a
    # user's newer torch, where the warning says what is untested.
    install_requires=["torch>=2.13"],
    extras_require={
        # numpy: torch's object collectives import it in CPU builds (DESIGN.md §6.5). transformers: real
        # model families, built from small configs in memory; accelerate, lightning and peft: the
        # clients' own code runs against fsdp1 (pinned: the versions the tests were run with). hypothesis:
        # the fuzzer (tests/test_fuzz.py). ruff: the linter `make test` runs first (pinned: rules change).
        # mypy: the type checker of the package, configured in mypy.ini (pinned: checks change). torchao:
        # a real all-gather extension (its int8 training weights), which runs on CPU. pytest-xdist: the
        # suite runs on two workers, since one leaves the cores idle about 40% of the time (its ranks
        # and launched jobs wait on each other and on timeouts).
        "test": ["pytest>=7", "expecttest>=0.2", "numpy", "transformers==5.23.0", "accelerate==1.15.0",
                 "lightning==2.6.6", "peft==0.21.0", "hypothesis>=6.100", "ruff==0.17.6", "mypy==2.4.1",
                 "torchao==0.18.0", "pytest-xdist==3.8.0"],
        # train: what `make train` needs besides torch: the progress bar, and numpy, through which torch's
        # distributed checkpoint (the example's checkpoints) gathers objects (torch does not install it);
        # examples: the other examples and tools' plots and safetensors files.
        "train": ["tqdm", "numpy"],
        "examples": ["tqdm", "matplotlib", "safetensors"],
    },
)
