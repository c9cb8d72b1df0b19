# Each target installs what it needs first, so it works on a fresh machine, and installs it into a
# virtual environment: the active one, or else .venv here (made on first use), never the Python that
# runs make. torch is pinned here (not in setup.py): a bare `torch` requirement pulls a multi-GB CUDA
# build. pip picks the CPU build only where it is pointed at torch's CPU wheels (README: Install).
BASE_PYTHON ?= python3
TORCH ?= torch==2.13.0
# One environment per torch release: .venv for the default pin, .venv-X.Y.Z for `make test TORCH=torch==X.Y.Z`.
VENV ?= .venv$(if $(filter torch==2.13.0,$(TORCH)),,-$(subst torch==,,$(TORCH)))
ifdef VIRTUAL_ENV
PYTHON ?= $(VIRTUAL_ENV)/bin/python
else
PYTHON ?= $(VENV)/bin/python
endif
PIP = $(PYTHON) -m pip install -q "$(TORCH)"
TORCHRUN = OMP_NUM_THREADS=1 $(PYTHON) -m torch.distributed.run --standalone --nproc-per-node 2
MIGRATION = examples/ddp_to_fsdp1

.PHONY: test test-without-torch-fsdp1 fuzz train migrate accelerate-example fully-shard benchmark gpu-check install install-train install-examples

$(VENV)/bin/python:
	$(BASE_PYTHON) -m venv $(VENV)

# What the tests need: the linters, the clients (Transformers, Accelerate, Lightning, PEFT), torchao.
install: $(if $(VIRTUAL_ENV),,$(VENV)/bin/python)
	$(PIP) -e ".[test]"

# What `make train` needs: torch, fsdp1, a progress bar and numpy (for torch's distributed checkpoint).
install-train: $(if $(VIRTUAL_ENV),,$(VENV)/bin/python)
	$(PIP) -e ".[train]"

# The other examples and tools: the clients (Accelerate, Transformers), plots, safetensors.
install-examples: $(if $(VIRTUAL_ENV),,$(VENV)/bin/python)
	$(PIP) -e ".[test,examples]"

test: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m mypy
	$(PYTHON) -m pytest -q -n 2 --durations=20 tests

# torch as it will be once it drops FSDP1 (tests/without_torch_fsdp1/sitecustomize.py): FSDP1's modules
# refused to all but torch's FSDP2 and DCP; the tests that use torch's FSDP1 as an oracle skip, saying so.
test-without-torch-fsdp1: install
	FSDP1_WITHOUT_TORCH_FSDP1=1 PYTHONPATH=$(CURDIR)/tests/without_torch_fsdp1 $(PYTHON) -m pytest -q tests

# The fuzzer beyond CI's 30 + 6 cases (about 0.3 s a case, 2 s a stack case run by fsdp1 and by torch);
# a failure is shrunk to a minimal case.
fuzz: install
	FSDP1_FUZZ_EXAMPLES=500 FSDP1_FUZZ_STACK_EXAMPLES=60 FSDP1_FUZZ_SHRINK=1 $(PYTHON) -m pytest -q tests/test_fuzz.py

# A fresh run each time: it saves into out/checkpoints, which --resume continues (see docs/commands.md).
train: install-train
	rm -rf out/checkpoints
	$(TORCHRUN) examples/train_gpt.py

migrate: install-examples
	mkdir -p out
	$(TORCHRUN) -m examples.ddp_to_fsdp1.train_ddp --losses out/ddp_losses.json
	$(TORCHRUN) -m examples.ddp_to_fsdp1.train_fsdp1 --losses out/fsdp1_losses.json
	$(PYTHON) $(MIGRATION)/compare_losses.py out/ddp_losses.json out/fsdp1_losses.json --plot out/losses.png
	diff $(MIGRATION)/train_ddp.py $(MIGRATION)/train_fsdp1.py || true

ACCELERATE = $(TORCHRUN) examples/hf_accelerate_fsdp1.py --checkpoint out/accelerate_checkpoint
accelerate-example: install-examples
	rm -rf out/accelerate_checkpoint
	$(ACCELERATE) --losses out/accelerate_run.json
	$(ACCELERATE) --resume --expect out/accelerate_run.json
	$(ACCELERATE) --impl torch --checkpoint out/accelerate_torch_checkpoint --expect out/accelerate_run.json

# FSDP1 -> FSDP2: a fully_shard run, then a FullyShardedDataParallel run to step 100 whose checkpoint a
# fully_shard run resumes; its losses must equal the uninterrupted fully_shard run's, bit for bit.
FULLY_SHARD = $(TORCHRUN) -m examples.train_gpt_fully_shard --steps 200
fully-shard: install-examples
	rm -rf out/fsdp1_checkpoints out/fully_shard_checkpoints
	$(FULLY_SHARD) --losses out/fully_shard_losses.json
	$(TORCHRUN) examples/train_gpt.py --steps 100 --checkpoint-dir out/fsdp1_checkpoints
	$(FULLY_SHARD) --resume-from out/fsdp1_checkpoints --checkpoint-every 0 --expect out/fully_shard_losses.json

benchmark: install-examples
	$(PYTHON) -m tools.benchmark --json out/benchmark.json

# On a machine with a CUDA GPU: fsdp1 against torch's FSDP there (tools/gpu_check.py). It installs
# nothing and runs on the Python named here (the environment `make test` made, else python3), whose
# torch must be a CUDA build; without CUDA it says so and exits 0.
GPU_PYTHON ?= $(if $(wildcard $(PYTHON)),$(PYTHON),python3)
gpu-check:
	$(GPU_PYTHON) -m tools.gpu_check
