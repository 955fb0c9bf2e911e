"""A lint of the CUDA habits that bite only on a GPU (issue #41), read from the source.

- A tensor factory (`torch.zeros`, `empty`, `tensor`, ...) in `parallel/` or the step
  (`worker/step.py`) names its `device=`: one without lands on the CPU and meets a CUDA
  tensor later (or costs a host-to-device copy per step). The allowlist says why each
  exception is safe.
- `torch.cuda.Stream()` names its device (one without binds to the thread's current
  device, GPU 0 on a fresh thread); `torch.cuda.Event` takes none (it binds to the stream
  it is first recorded on), so each one is listed with the stream it is recorded on.
- A thread whose class touches CUDA (`torch.cuda`, a collective's `is_completed`) sets
  its device first: a new thread starts on GPU 0 (item 2, the collective watch).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "raytrain_ddp"
FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint", "as_tensor",
             "linspace", "eye", "scalar_tensor"}
# (file, source of the call): why it may stay on the CPU
ALLOWED = {
    ("parallel/base.py", "torch.empty(0)"): "a placeholder to read `.device` from a module with no parameters",
    ("parallel/bucketed.py", "torch.empty(0)"): "an empty placeholder view, replaced before use",
    ("parallel/zero1.py", "torch.empty(0)"): "an empty placeholder view, replaced before use",
    ("parallel/shm.py", "torch.zeros(16, dtype=torch.uint8)"): "shared-memory exchange: CPU (gloo) tensors only",
    ("parallel/shm.py", "torch.tensor([segments is not None], dtype=torch.int32)"): "shm: CPU only",
    ("parallel/shm.py", "torch.zeros(1, dtype=torch.int32)"): "shm: CPU only",
}
EVENTS = {  # file: where its events are recorded
    "parallel/bucketed.py": "GpuSpan: on the training thread's current stream, whose device the worker set",
    "recovery/replica.py": "LastStep: on torch.cuda.current_stream(self.device), the module's own device",
    "worker/validator.py": "the model copied: on the loop's current stream, before the side stream waits on it",
}
CUDA_MARKERS = ("torch.cuda", "is_completed", ".synchronize(")

pytestmark = pytest.mark.timeout(60)


def _calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            yield node, ast.unparse(node.func)


def _rel(path: Path) -> str:
    return str(path.relative_to(PACKAGE))


def test_tensor_factories_name_their_device():
    files = sorted((PACKAGE / "parallel").glob("*.py")) + [PACKAGE / "worker" / "step.py"]
    found = set()
    for path in files:
        for node, func in _calls(path):
            if func.startswith("torch.") and func[6:] in FACTORIES and not any(k.arg == "device" for k in node.keywords):
                found.add((_rel(path), ast.unparse(node)))
    assert found - set(ALLOWED) == set(), "tensor factories without device= (name one, or allowlist with a reason)"
    assert set(ALLOWED) - found == set(), "allowlist entries that no longer exist: remove them"


def test_cuda_streams_name_their_device_and_events_are_listed():
    streams, events = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node, func in _calls(path):
            if func in ("torch.cuda.Stream", "cuda.Stream") and not (node.args or any(k.arg == "device" for k in node.keywords)):
                streams.append((_rel(path), node.lineno))
            if func in ("torch.cuda.Event", "cuda.Event"):
                events.add(_rel(path))
    assert streams == [], "torch.cuda.Stream() without a device binds to the thread's current device"
    assert events <= set(EVENTS), f"CUDA events outside {sorted(EVENTS)}: say which stream records them"


def test_threads_that_touch_cuda_set_their_device_first():
    checked = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
            methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
            for node in ast.walk(cls):
                if not (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("Thread")):
                    continue
                target = next((ast.unparse(k.value) for k in node.keywords if k.arg == "target"), "")
                method = methods.get(target.removeprefix("self."))
                assert method is not None, f"{_rel(path)}:{node.lineno}: a thread target this lint cannot read"
                if any(m in ast.unparse(cls) for m in CUDA_MARKERS):
                    assert "set_device" in ast.unparse(method), (
                        f"{_rel(path)}:{node.lineno}: {cls.name}'s thread touches CUDA without torch.cuda.set_device")
                checked.append(f"{_rel(path)}:{cls.name}")
    assert "parallel/watch.py:CollectiveWatch" in checked  # the lint sees the thread of item 2
