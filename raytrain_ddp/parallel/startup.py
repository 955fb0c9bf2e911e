"""Start-up sync at wrap time: rank 0's parameters and buffers to every rank, or compared.

Owns: the structure check (every rank wraps the same parameter names, shapes, dtypes),
the broadcast of rank 0's state (`broadcast_coalesced`, also torch DDP's buffer re-sync
before a forward) and `verify_init`'s comparison, which raises `ModelMismatchError`
naming the first tensor that differs. Must not touch: Ray, anything of ours outside
`parallel/`; only torch and torch.distributed.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from torch import nn

from raytrain_ddp.parallel.errors import ModelMismatchError
from raytrain_ddp.parallel import torch_compat
from raytrain_ddp.parallel.collectives import collective


def broadcast_coalesced(tensors: list[torch.Tensor], pg) -> int:
    """Overwrite `tensors` with group rank 0's, one broadcast per (dtype, device); returns bytes.

    torch DDP's buffer sync (`_sync_buffers`): in place, without bumping version counters
    (a buffer saved for backward must not look modified).
    """
    if not tensors:
        return 0
    src = dist.get_global_rank(pg, 0) if pg is not None else 0
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    nbytes = 0
    with torch.no_grad(), torch_compat.unsafe_preserve_version_counter(tuple(tensors)):
        for group in groups.values():
            flat = torch_compat.flatten_dense_tensors([t.detach() for t in group])
            with collective("broadcast of the buffers"):
                dist.broadcast(flat, src=src, group=pg)
            nbytes += flat.numel() * flat.element_size()
            for t, synced in zip(group, torch_compat.unflatten_dense_tensors(flat, group)):
                t.copy_(synced)
    return nbytes


# -- start-up: same structure everywhere, then rank 0's weights everywhere --------------

def _named_state(module: nn.Module, buffers: bool = True) -> list[tuple[str, str, torch.Tensor]]:
    """Parameters then buffers, in registration order: the order every rank broadcasts in."""
    items = [("parameter", n, p) for n, p in module.named_parameters()]
    if buffers:
        items += [("buffer", n, b) for n, b in module.named_buffers()]
    return items


def check_structure(module: nn.Module, pg, world_size: int, world_rank: int) -> None:
    """One tiny all-reduce so a rank with a different model fails clearly instead of hanging."""
    items = _named_state(module)
    device = items[0][2].device if items else torch.device("cpu")
    signature = ";".join(f"{kind}:{name}:{tuple(t.shape)}:{t.dtype}" for kind, name, t in items)
    crc = zlib.crc32(signature.encode())
    flags = torch.tensor([crc, -crc], dtype=torch.int64, device=device)
    with collective("all-reduce of the model's structure"):
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=pg)
    if flags[0].item() != crc or flags[1].item() != -crc:
        raise ModelMismatchError(
            f"the model's structure differs across ranks (rank {world_rank} of {world_size} has "
            f"{len(items)} parameters/buffers, signature crc32={crc}); every rank must build the "
            "same model (same names, shapes and dtypes) before wrap_model"
        )


def sync_initial_state(module: nn.Module, pg, *, verify: bool, world_size: int, world_rank: int,
                       buffers: bool = True) -> None:
    """Broadcast rank 0's parameters and buffers (verify=False), or check they already agree.

    `buffers=False` (torch DDP's broadcast_buffers=False) leaves each rank's buffers its own.

    With verify=True nothing is overwritten: every rank compares its tensors with rank 0's
    and a flag matrix is all-reduced, so every rank (not only the odd one out) raises the
    same `ModelMismatchError` naming the first differing tensor; no rank is left waiting.
    """
    items = _named_state(module, buffers)
    if not items:
        return
    device = items[0][2].device
    check_structure(module, pg, world_size, world_rank)
    src = dist.get_global_rank(pg, 0) if pg is not None else 0
    differs = torch.zeros(world_size, len(items), dtype=torch.int32, device=device)
    max_diff: dict[int, float] = {}
    with torch.no_grad():
        for i, (_, _, tensor) in enumerate(items):
            reference = tensor.detach().clone() if verify else tensor.data  # verify: compare before taking it
            with collective("broadcast of rank 0's weights"):
                dist.broadcast(reference, src=src, group=pg)
            if not verify:
                continue
            if not torch.equal(reference, tensor.detach()):
                differs[world_rank, i] = 1
                if tensor.is_floating_point() and tensor.numel():
                    max_diff[i] = (reference - tensor.detach()).abs().max().item()
    if not verify:
        return
    with collective("all-reduce of the weight check"):
        dist.all_reduce(differs, group=pg)  # everyone learns every rank's verdict
    bad_items = differs.any(dim=0).nonzero()
    if bad_items.numel():
        i = int(bad_items[0])
        kind, name, _ = items[i]
        ranks = differs[:, i].nonzero().flatten().tolist()
        n_bad = bad_items.numel()
        here = f" (max abs difference on this rank: {max_diff[i]:g})" if i in max_diff else ""
        raise ModelMismatchError(
            f"model parameters are not the same on all processes: {kind} '{name}' on rank(s) "
            f"{ranks} differs from rank 0{here}; {n_bad} of {len(items)} tensors differ. "
            "Seed every rank identically before building the model (torch.manual_seed), or "
            "wrap with verify_init=False to broadcast rank 0's weights instead."
        )
