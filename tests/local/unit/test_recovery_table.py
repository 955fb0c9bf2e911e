"""The recovery table (`recovery/table.py`): one row per `run.recovery` value, its halves chosen once,
and the only module that reads `run.recovery`'s values (issue #42); live's group by device (#41)."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest
import torch

from raytrain_ddp.config import load_config
from raytrain_ddp.config.schema import RunConfig
from raytrain_ddp.recovery import table

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(table.__file__).resolve().parents[1]
QUICKSTART = PACKAGE.parent / "examples" / "configs" / "quickstart.yaml"


def test_the_table_has_a_row_for_each_value_of_run_recovery():
    values = typing.get_args(RunConfig.model_fields["recovery"].annotation)
    assert set(table.NAMES) == set(values)
    for row in table.MODES.values():
        assert callable(row.load_driver()) and callable(row.load_worker()), row.name
        for member in ("resolve", "env", "torch_config", "callbacks"):
            assert hasattr(row.load_driver(), member), (row.name, member)
        for member in ("for_worker", "resume", "train_step", "wrapper_group", "close"):  # declared, or set from parts
            assert member in {*dir(row.load_worker()), *row.load_worker().__annotations__}, (row.name, member)


@pytest.mark.parametrize("recovery, strategy, copy, worker", [
    ("checkpoint", "bucketed", False, "Steady"), ("replica", "bucketed", True, "Steady"),
    ("replica", "zero1", False, "Steady"), ("live", "native", True, "LiveSession")])
def test_rows_choose_the_halves_and_the_survivors_copy(recovery, strategy, copy, worker):
    cfg = load_config(QUICKSTART, [f"run.recovery={recovery}", f"parallel.strategy={strategy}",
                                   "scaling.num_workers=2"])
    assert table.survivors_copy(cfg) is copy
    assert table.worker_half(cfg).__name__ == worker
    local = load_config(QUICKSTART, [f"run.recovery={recovery}", "scaling.num_workers=0"])
    assert table.worker_half(local).__name__ == "Steady"  # no replica groups without Ray


def test_under_checkpoint_recovery_the_loop_calls_the_step_itself():
    from raytrain_ddp.worker.loop import PARTS
    from raytrain_ddp.worker.step import train_step

    cfg = load_config(QUICKSTART, ["run.recovery=checkpoint"])
    assert table.worker_half(cfg).for_worker(None, None, PARTS).train_step is train_step


def _recovery_comparisons(path: Path) -> list[int]:
    """Lines comparing `<x>.recovery` with something (==, !=, in), outside the table."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                if isinstance(side, ast.Attribute) and side.attr == "recovery":
                    lines.append(node.lineno)
    return lines


def test_run_recovery_is_compared_only_in_the_tables_module():
    bad = [f"{path.relative_to(PACKAGE.parent).as_posix()}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
           if path != Path(table.__file__).resolve() for line in _recovery_comparisons(path)]
    assert not bad, "run.recovery compared outside recovery/table.py:\n" + "\n".join(bad)


def test_live_uses_torchfts_nccl_group_on_cuda_and_gloo_on_the_cpu():
    """#41 bug 3: torchft's gloo group also takes CUDA tensors, through host memory."""
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    from raytrain_ddp.recovery.live_group import live_group_base, live_group_class

    assert live_group_base(torch.device("cuda", 3)) == (ProcessGroupNCCL, "nccl")
    assert live_group_base(torch.device("cpu")) == (ProcessGroupGloo, "gloo")
    assert live_group_base(None) == (ProcessGroupGloo, "gloo")
    cuda_group = live_group_class(torch.device("cuda", 0))
    assert issubclass(cuda_group, ProcessGroupNCCL) and cuda_group.backend_name == "nccl"
    assert issubclass(live_group_class(torch.device("cpu")), ProcessGroupGloo)
