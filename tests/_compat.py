"""One lookup for the compat rooms' tests (ray_compat, torch_compat): import `module.path:attr.attr`
and fail by the name of the room's function that uses it, so a changed private name says which
of our functions it breaks."""

from __future__ import annotations

import importlib
from typing import Any, Callable

import pytest


def attr_or_fail(gone: Callable[[str, str], str], function: str, dotted: str) -> Any:
    """`dotted` is `module.path:attr.attr`; `gone(function, what)` words the failure."""
    module_name, _, attrs = dotted.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError:
        pytest.fail(gone(function, module_name))
    for part in attrs.split(".") if attrs else []:
        if not hasattr(obj, part):
            pytest.fail(gone(function, f"{module_name}:{attrs}"))
        obj = getattr(obj, part)
    return obj


def ray_gone(function: str, what: str) -> str:
    """ray_compat's tests' wording: which of its functions a changed Ray name breaks."""
    import ray

    return f"ray_compat.{function}: {what} is gone in ray {ray.__version__}"
