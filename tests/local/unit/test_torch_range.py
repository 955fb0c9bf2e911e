"""The torch range is honest (docs/parallel.md, audit item 6): pyproject's floor is what
`make compat` runs, and an older torch fails `fsdp` at wrap time with a clear error, not
deep inside FSDP2."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from raytrain_ddp.parallel import fsdp

ROOT = Path(__file__).resolve().parents[3]


def test_fsdp_names_what_an_older_torch_lacks(monkeypatch):
    fsdp.check_fsdp2_support()  # this torch has everything
    from torch.distributed.fsdp import FSDPModule

    monkeypatch.delattr(FSDPModule, "set_force_sum_reduction_for_comms")
    with pytest.raises(RuntimeError, match=rf"torch {re.escape(torch.__version__)} lacks: "
                                           r"FSDPModule.set_force_sum_reduction_for_comms\..*'zero1'"):
        fsdp.check_fsdp2_support()


def test_declared_floor_is_what_make_compat_builds():
    pyproject = (ROOT / "pyproject.toml").read_text()
    floor, cap = re.search(r'"torch>=([\d.]+),<([\d.]+)"', pyproject).groups()
    makefile = (ROOT / "Makefile").read_text()
    versions = re.search(r"^COMPAT_TORCH \?= (.+)$", makefile, re.M).group(1).split()
    assert versions[0].startswith(floor), (floor, versions)  # the floor is the oldest tested
    assert all(tuple(map(int, v.split(".")[:2])) < tuple(map(int, cap.split("."))) for v in versions)
    installed = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
    assert tuple(map(int, floor.split(".")[:2])) <= installed < tuple(map(int, cap.split(".")))


def test_fsdp_asks_for_unused_parameter_reduce_scatter_only_with_find_unused(monkeypatch):
    """torch 2.11 (the GPU machine's) lacks set_reduce_scatter_unused_params: fsdp runs there
    with its default (off, what a torch without it does) and refuses only the option it serves."""
    from torch.distributed.fsdp import FSDPModule

    monkeypatch.delattr(FSDPModule, fsdp.FSDP2_UNUSED_METHOD, raising=False)  # 2.11 has none
    fsdp.check_fsdp2_support()
    fsdp.check_fsdp2_support(find_unused_parameters=False)
    with pytest.raises(RuntimeError, match=r"'fsdp' with parallel.find_unused_parameters needs FSDP2 APIs "
                                           r".* lacks: FSDPModule.set_reduce_scatter_unused_params\."):
        fsdp.check_fsdp2_support(find_unused_parameters=True)
