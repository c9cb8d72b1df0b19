"""Tests the code in the README and the guides as a reader copies it: every ``python`` block compiles,
and every block marked ``<!-- runnable -->`` (one process) or ``<!-- runnable: 2 ranks -->`` (under
torchrun, gloo) runs to a clean exit from an empty folder, so a guide cannot rot."""

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- runnable(?P<ranks>: 2 ranks)? -->\n)?```python\n(?P<code>.*?)```", re.S)


def _blocks():
    for page in PAGES:
        text = page.read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start("code")) + 1
            runnable = "<!-- runnable" in text[match.start():match.start("code")]
            yield f"{page.relative_to(ROOT)}:{line}", match.group("code"), runnable, bool(match.group("ranks"))


BLOCKS = list(_blocks())
RUNNABLE = [block for block in BLOCKS if block[2]]


@pytest.mark.parametrize("where, code", [(where, code) for where, code, _, _ in BLOCKS], ids=[b[0] for b in BLOCKS])
def test_every_python_block_compiles(where, code):
    compile(code, where, "exec")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every runnable block started as it is first asked for, two at a time (each mostly imports), each
    from an empty folder of its own: ``where`` -> its finished process, once waited for."""
    pool = ThreadPoolExecutor(max_workers=2)
    started = {where: pool.submit(_run, where, code, on_ranks, tmp_path_factory.mktemp("snippet"))
               for where, code, _, on_ranks in RUNNABLE}
    yield started
    pool.shutdown(cancel_futures=True)


def _run(where, code, on_ranks, folder):
    script = folder / "snippet.py"
    script.write_text(code)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] if on_ranks else [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([*launch, str(script)], cwd=folder, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("where", [where for where, _, _, _ in RUNNABLE])
def test_runnable_blocks_run(where, runs):
    run = runs[where].result()
    assert run.returncode == 0, f"{where}:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"


def test_the_pages_have_runnable_blocks():
    """The marker is spelled as the test reads it: a misspelt one would silently leave a block unrun."""
    marked = sum(page.read_text().count("<!-- runnable") for page in PAGES)
    assert marked == len(RUNNABLE) >= 2
