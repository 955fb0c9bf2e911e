"""A CPU stand-in for "the model lives on a GPU": where host tensors would meet device ones.

Why not `FakeTensorMode` with `module.to("cuda")`: on a CPU-only torch build no CUDA
`DeviceGuardImpl` is registered, so the first kernel on a fake CUDA tensor (`Tensor.to`,
`nn.init`'s `uniform_`) raises "PyTorch is not linked with support for cuda devices"; on
a CUDA build without a GPU (the compat venvs' 2.11 and 2.15) forward runs but backward
does not: the autograd engine starts its CUDA device threads, which ask for a primary
context ("hasPrimaryContext expects a valid device index"). Both measured (issue 41).

`ShadowDevice` instead tracks, with a `TorchFunctionMode`, which tensors are host ones:
tensors handed to it by `host(...)` (a batch before the step moves it) and those a factory
(`torch.zeros`, `torch.tensor`, ...) builds without `device=` inside the mode, and the
results of ops over host tensors only. Everything else counts as on the device (the
model, its buffers, what the wrappers build with `device=`). It raises where a GPU would:
a host tensor of one or more dimensions meeting a device tensor in one op (0-dim host
tensors may, as CUDA allows), and counts host reads of device tensors (`.item()`,
`bool()`, `float()`, `.tolist()`): on CUDA each is a sync. `Tensor.to(device)` /
`.cuda()` give a device tensor. Test-only.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from raytrain_ddp.parallel import torch_compat

READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
         torch.Tensor.__int__, torch.Tensor.__index__}
MOVES = {torch.Tensor.to, torch.Tensor.cuda}


class DeviceMismatch(RuntimeError):
    """A host tensor met a device tensor in one op (on a GPU: a device mismatch or a copy)."""


class ShadowDevice(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self._host: dict[int, weakref.ref] = {}  # id -> weakref (a WeakSet would compare tensors)
        self.reads: list[str] = []

    def host(self, *tensors: Any) -> None:
        for t in torch_compat.tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                self._host[id(t)] = weakref.ref(t)

    def _forget(self, t: torch.Tensor) -> None:
        self._host.pop(id(t), None)

    def is_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in torch_compat.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func in READS:
            if tensors and not self.is_host(tensors[0]):
                self.reads.append(getattr(func, "__name__", str(func)))
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if func in MOVES:
            moved = bool([a for a in args[1:] if isinstance(a, (torch.device, str))] or "device" in kwargs
                         or func is torch.Tensor.cuda)
            if moved and out is args[0]:  # already there on this CPU: a device copy on a GPU
                out = out.detach().requires_grad_(out.requires_grad) if out.is_leaf else out.view_as(out)
            if moved:
                self._forget(out)
                return out
        if func in torch_compat.device_constructors() and kwargs.get("device") is None and not tensors:
            self.host(out)
            return out
        host = [t for t in tensors if self.is_host(t)]
        device = [t for t in tensors if not self.is_host(t)]
        if device and any(t.dim() > 0 for t in host):
            shapes = [tuple(t.shape) for t in host if t.dim() > 0]
            raise DeviceMismatch(f"{getattr(func, '__name__', func)}: host tensor(s) of shape {shapes} "
                                 "meet device tensors (on a GPU: a device mismatch)")
        if tensors and not device:
            self.host(out)
        return out
