"""Every private torchft name `torchft_compat.py` relies on is still where it looks (issue #42).

Each test fails by name: "torchft_compat.X: <what> is gone in torchft <version>".
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

import torchft  # in the dev extra: a missing one fails, it does not skip

from raytrain_ddp import torchft_compat

pytestmark = pytest.mark.timeout(60)


def _gone(function: str, what: str) -> str:
    return f"torchft_compat.{function}: {what} is gone in torchft {getattr(torchft, '__version__', '?')}"


def _source_has(function: str, cls: Any, method: str, text: str) -> None:
    if text not in inspect.getsource(getattr(cls, method)):
        pytest.fail(_gone(function, f"{cls.__name__}.{method} setting {text}"))


def test_raised_in_torchft():
    import torchft.process_group

    if "torchft/" not in torchft.process_group.__file__.replace("\\", "/"):
        pytest.fail(_gone("raised_in_torchft", "torchft's modules under a torchft/ folder"))
    try:
        torchft.process_group.ProcessGroupGloo().allreduce([], None)  # not configured: it raises in torchft
    except Exception as exc:  # noqa: BLE001 - whatever torchft raises, its frames are torchft's
        assert torchft_compat.raised_in_torchft(exc)
    try:
        raise RuntimeError("ours")
    except RuntimeError as exc:
        assert not torchft_compat.raised_in_torchft(exc)


def test_bound_manager():
    import torchft.manager as torchft_manager

    if not hasattr(torchft_manager, "ManagerServer"):
        pytest.fail(_gone("bound_manager", "torchft.manager.ManagerServer"))
    _source_has("bound_manager", torchft_manager.Manager, "__init__", "ManagerServer(")
    _source_has("bound_manager", torchft_manager.Manager, "__init__", "bind=bind")
    if "bind" not in inspect.signature(torchft_manager.ManagerServer).parameters and "bind" not in (
            torchft_manager.ManagerServer.__init__.__doc__ or "") + (torchft_manager.ManagerServer.__doc__ or ""):
        pytest.fail(_gone("bound_manager", "ManagerServer(bind=...)"))
    assert torchft_compat.bracketed("::1") == "[::1]" and torchft_compat.bracketed("10.0.0.1") == "10.0.0.1"


def test_create_pg():
    """recovery/live_group.py's LiveGroup overrides `_create_pg(store, rank, world_size)` of torchft's groups."""
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    for cls in (ProcessGroupGloo, ProcessGroupNCCL):
        if not hasattr(cls, "_create_pg"):
            pytest.fail(_gone("LiveGroup (recovery/live_group.py)", f"{cls.__name__}._create_pg"))
        assert list(inspect.signature(cls._create_pg).parameters)[1:4] == ["store", "rank", "world_size"], \
            _gone("LiveGroup (recovery/live_group.py)", f"{cls.__name__}._create_pg(store, rank, world_size)")
