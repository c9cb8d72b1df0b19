"""Tests ``make gpu-check``'s script on this machine: without CUDA it says so and succeeds, and its
checks themselves (fsdp1 against torch's FSDP1 and ``fully_shard`` at world size 1) run on the CPU
over gloo and agree with torch's, so the script a GPU session runs is known to work."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _gpu_check(*args):
    return subprocess.run([sys.executable, "-m", "tools.gpu_check", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run")
def test_without_cuda_it_says_so_and_succeeds():
    run = _gpu_check()
    assert run.returncode == 0, run.stderr
    assert "no CUDA device here" in run.stdout


def test_its_checks_agree_with_torch_on_the_cpu():
    run = _gpu_check("--device", "cpu", "--small")
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith(("FSDP1 ", "fully_shard"))]
    assert len(rows) == 9 and all(" yes " in row for row in rows), run.stdout
    assert "every check agrees with torch's" in run.stdout
