# Each target installs what it needs first, so it works on a fresh machine.
# torch is pinned here (not in setup.py): a bare `torch` requirement pulls a multi-GB CUDA build.
PYTHON ?= python3
TORCH ?= torch==2.13.0

.PHONY: test train install

install:
	$(PYTHON) -m pip install -q "$(TORCH)" -e ".[test]"

test: install
	$(PYTHON) -m pytest -q tests

train: install
	OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 examples/train_gpt.py
