"""`raytrain-ddp export RUN_DIR OUT.pt`: a run's trained model, for use without Ray or a trainer.

Owns: the export file, one `torch.save`d dict of plain values, loadable anywhere with
`torch.load(path, weights_only=True)`:

    model    the bare model's state_dict (what `factory(spec, **model.kwargs)` loads)
    config   the run's resolved config, as YAML text
    spec     the data's `DataSpec` as plain values (`DataSpec.from_state_dict`), or None
    step, epoch, checkpoint   where the weights come from

Must not touch: Ray, training, the checkpoint format (`checkpoint.py` reads and verifies
the newest valid checkpoint; this module only picks out what a user needs).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.errors import CheckpointError

FORMAT = 1


def export_run(run_dir: Union[str, os.PathLike], out: Union[str, os.PathLike]) -> Path:
    """Write the newest valid checkpoint's model, config and data spec of `run_dir` to `out`."""
    found = ckpt.load_latest_valid(ckpt.find_checkpoints(run_dir))
    if found is None:
        raise CheckpointError(f"{run_dir}: no valid checkpoint to export (train first, or check the path)")
    state, path = found
    run = state.get("run", {})
    payload = {
        "format": FORMAT,
        "model": state["model"],
        "config": run.get("config"),
        "spec": run.get("spec"),
        "step": int(state["progress"]["step"]),
        "epoch": int(state["progress"]["epoch"]),
        "checkpoint": str(path),
    }
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(buffer.getvalue())
    os.replace(tmp, out)
    return out


def load_model(path: Union[str, os.PathLike], factory: Optional[Callable[..., Any]] = None,
               config_path: Union[str, os.PathLike, None] = None) -> torch.nn.Module:
    """The exported model, built and loaded, in eval mode (no Ray involved).

    `factory`: your model factory (default: the one the run's `model.name` names, imported
    from the current directory, `config_path`'s directory or sys.path).
    """
    import yaml

    from raytrain_ddp.config import validate_config
    from raytrain_ddp.job import DataSpec
    from raytrain_ddp.user import UserCode, resolve

    exported = torch.load(path, map_location="cpu", weights_only=True)
    cfg = validate_config(yaml.safe_load(exported["config"]), source=str(path))
    if exported.get("spec") is None:
        raise CheckpointError(f"{path}: exported without a data spec (a checkpoint from before issue #11)")
    spec = DataSpec.from_state_dict(exported["spec"])
    code = UserCode(model=factory) if factory is not None else resolve(cfg, config_path=config_path)[1]
    model = code.build_model(cfg, spec)
    model.load_state_dict(exported["model"])
    return model.eval()
