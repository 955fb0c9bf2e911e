"""The documentation's runnable blocks marked `ray` (they start Ray), run verbatim in a copy of
the repository as tests/local/docs/test_doc_blocks.py runs the others (tests/_doc_blocks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from _doc_blocks import RUNNABLE, Block, copy_repo, param, run_block


@pytest.mark.parametrize("block", [param(b) for b in RUNNABLE if b.ray])
def test_runnable_block(block: Block, tmp_path: Path):
    result = run_block(block, copy_repo(tmp_path))
    assert result.returncode == block.exit, (
        f"{block.where}: block exited {result.returncode}, expected {block.exit}\n"
        f"--- block ---\n{block.text}--- stderr (tail) ---\n{result.stderr[-3000:]}\n"
        f"--- stdout (tail) ---\n{result.stdout[-1500:]}")
