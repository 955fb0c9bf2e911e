"""`run.recovery: live` (#28) pieces without Ray: who gets it, what a failed step is put back to.

- `live_driver.resolve`: zero1 / fsdp, elastic ranges, one worker and streaming data fall
  back to `replica` with one line naming why; naive / bucketed / native with a fixed count
  keep `live`; without torchft, a `ConfigError` naming `run.recovery`.
- `replica.is_peer_loss`: torch DDP's reducer re-raises our comm hook's
  `CollectiveTimeoutError` through autograd as a plain RuntimeError with no frame of ours;
  its text still makes it a lost peer.
- `live.rewind`: after a forward pass that moved BatchNorm's statistics and the RNG
  streams, the step's boundary comes back (and the gradients are dropped).
- `ray_compat.serve_partial_groups_whole_datasets`: a partial group (a replacement) gets the full
  group's dataset provider; a full group goes through Ray's own code.
"""

from __future__ import annotations

import os
import random
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from raytrain_ddp.config import ConfigError, load_config
from raytrain_ddp import ray_compat
from raytrain_ddp.recovery import live_driver as driver_live
from raytrain_ddp.recovery.live import rewind, tensor_bytes
from raytrain_ddp.recovery.replica import LastStep

pytestmark = pytest.mark.timeout(60)

QUICKSTART = "examples/configs/quickstart.yaml"


@pytest.mark.parametrize("overrides, reason", [
    (["parallel.strategy=zero1"], "parallel.strategy=zero1 keeps 1/W of the state"),
    (["parallel.strategy=fsdp"], "parallel.strategy=fsdp keeps 1/W of the state"),
    (["scaling.num_workers=[1,2]"], "scaling.num_workers is a range"),
    (["scaling.num_workers=1"], "one worker has no survivor"),
    (["data.sharding=streaming"], "data.sharding=streaming splits one Ray Data stream"),
])
def test_what_live_cannot_cover_falls_back_to_replica_in_one_line(overrides, reason):
    said: list[str] = []
    cfg = load_config(QUICKSTART, ["run.recovery=live", *overrides])
    resolved = driver_live.resolve(cfg, say=said.append)
    assert resolved.run.recovery == "replica" and cfg.run.recovery == "live"  # the caller's config is untouched
    assert len(said) == 1 and said[0].startswith("raytrain-ddp: run.recovery=live falls back to run.recovery=replica:")
    assert reason in said[0]


@pytest.mark.parametrize("strategy", ["naive", "bucketed", "native"])
def test_replicated_strategies_keep_live(strategy):
    import torchft  # noqa: F401 - in the dev extra: a missing one fails here, never skips
    said: list[str] = []
    cfg = load_config(QUICKSTART, ["run.recovery=live", f"parallel.strategy={strategy}"])
    assert driver_live.resolve(cfg, say=said.append).run.recovery == "live" and said == []
    other = load_config(QUICKSTART, ["run.recovery=checkpoint"])
    assert driver_live.resolve(other, say=said.append) is other and said == []


def test_live_without_torchft_is_an_error_naming_the_key(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft -> ImportError
    with pytest.raises(ConfigError, match=r"run.recovery=live needs the torchft package.*run.recovery=replica"):
        driver_live.resolve(load_config(QUICKSTART, ["run.recovery=live"]), say=lambda line: None)


def test_rewind_puts_buffers_rng_and_gradients_back_to_the_boundary():
    torch.manual_seed(3)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5))
    last = LastStep(module)  # the boundary: marked at construction
    before = {k: v.clone() for k, v in module.state_dict().items()}
    boundary = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    module.train()
    module(torch.randn(8, 4) * 5).sum().backward()  # moves running stats, draws dropout's mask
    np.random.rand(7), random.random()
    assert not torch.equal(module[1].running_mean, before["1.running_mean"])
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    rewind(SimpleNamespace(optimizer=optimizer, last_step=last, module=module, scaler=scaler))
    assert all(p.grad is None for p in module.parameters())
    for name, value in module.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert torch.equal(torch.get_rng_state(), boundary[0])
    assert (np.random.get_state()[1] == boundary[1]).all() and random.getstate() == boundary[2]


def test_tensor_bytes_counts_every_tensor_of_a_state_dict():
    state = {"model": {"w": torch.zeros(10, dtype=torch.float32)}, "optimizer": {"state": [torch.zeros(3, dtype=torch.int64)]},
             "progress": {"step": 4}, "run": {"config": "text"}}
    assert tensor_bytes(state) == 10 * 4 + 3 * 8


def test_a_replacement_gets_the_full_groups_dataset_provider(monkeypatch):
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

    calls: list[int] = []

    def ray_own(self, workers):
        calls.append(len(workers))
        self._dataset_shard_provider = f"provider-of-{len(workers)}"
        return {"dataset_shard_provider": [self._dataset_shard_provider] * len(workers)}

    monkeypatch.setattr(DatasetsCallback, "before_init_train_context", ray_own)
    assert ray_compat.serve_partial_groups_whole_datasets() is True
    assert ray_compat.serve_partial_groups_whole_datasets() is False  # once per process
    callback = DatasetsCallback.__new__(DatasetsCallback)
    assert callback.before_init_train_context(["w0", "w1"]) == {"dataset_shard_provider": ["provider-of-2"] * 2}
    assert callback.before_init_train_context(["w1-new"]) == {"dataset_shard_provider": ["provider-of-2"]}
    assert callback.before_init_train_context(["a", "b"]) == {"dataset_shard_provider": ["provider-of-2"] * 2}
    assert calls == [2, 2]  # a full (re)start is Ray's own path


def test_a_worker_without_rays_torchft_backend_recovers_as_replica(monkeypatch, capsys):
    from raytrain_ddp.worker.context import Rank
    from raytrain_ddp.recovery import table
    from raytrain_ddp.recovery.steady import Steady as NoLive
    from raytrain_ddp.worker.loop import PARTS

    def session_for(job, runtime):  # as the loop builds the half
        return table.worker_half(job.cfg).for_worker(job, runtime, PARTS)

    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    runtime = SimpleNamespace(rank=lambda: Rank(0, 2, 0, torch.device("cpu")))
    job = SimpleNamespace(cfg=load_config(QUICKSTART, ["run.recovery=live"]))
    session = session_for(job, runtime)
    assert isinstance(session, NoLive) and session.runtime is runtime and session.wrapper_group() is None
    assert "TORCHFT_LIGHTHOUSE is not set" in capsys.readouterr().out
    local = SimpleNamespace(cfg=load_config(QUICKSTART, ["run.recovery=live", "scaling.num_workers=0"]))
    assert isinstance(session_for(local, runtime), NoLive) and capsys.readouterr().out == ""


def test_a_collective_error_that_torch_ddp_re_raised_is_a_peer_loss():
    from raytrain_ddp.recovery.replica import is_peer_loss

    def raised(message: str) -> RuntimeError:
        try:
            raise RuntimeError(message)  # from no frame of torch.distributed or of our wrappers
        except RuntimeError as exc:
            return exc

    ddp = raised("Got the following error when running the callback: CollectiveTimeoutError: all-reduce of "
                 "DDP bucket 1 (232 B, params: 1.bias) did not complete within 10s on rank 0 of 2 "
                 "(RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:21379)")
    assert is_peer_loss(ddp)
    assert not is_peer_loss(raised("mat1 and mat2 shapes cannot be multiplied (3x4 and 5x2)"))


def test_torchfts_lighthouse_and_manager_listen_on_the_given_address_only():
    """torchft binds both to every interface unless told; ours give the node's address (here loopback)."""
    from datetime import timedelta

    import torch.distributed as dist
    from torchft.coordination import LighthouseServer
    from torchft.process_group import ProcessGroupGloo

    from _procs import listening_sockets
    from raytrain_ddp.recovery.live_driver import HEARTBEAT_TIMEOUT_MS
    from raytrain_ddp.torchft_compat import bound_manager

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    manager = bound_manager("127.0.0.1", pg=ProcessGroupGloo(), min_replica_size=1, load_state_dict=None,
                            state_dict=None, use_async_quorum=False, rank=0, world_size=1, store_addr="127.0.0.1",
                            store_port=store.port, lighthouse_addr=lighthouse.address(), replica_id="r",
                            connect_timeout=timedelta(seconds=10))
    try:
        ports = {int(lighthouse.address().rsplit(":", 1)[1]), int(manager._manager.address().rsplit(":", 1)[1])}
        assert "127.0.0.1" in manager._manager.address()  # advertised as bound
        mine = {port: addr for addr, port, _, _ in listening_sockets([os.getpid()]) if port in ports}
        assert set(mine) == ports and set(mine.values()) == {"127.0.0.1"}, mine
    finally:
        manager.shutdown(wait=False)
        lighthouse.shutdown()


def test_a_start_fault_kills_only_replacements_of_its_rank_at_the_phases_asked(tmp_path):
    """`RAYTRAIN_DDP_FAULT_AT_START` (the live test's replacements that die before and after joining)."""
    import signal
    import subprocess

    from _hooks import START_FAULT_ENV, StartFault

    died, mark = tmp_path / "died_at", tmp_path / "newcomers"
    fault = StartFault(rank=1, after=str(died), mark=str(mark), when=("start", "joined"))
    fault.strike_if_due(1, "start")  # the first process of rank 1: nothing has died yet, it lives
    died.write_text("1.0")
    fault.strike_if_due(0, "start")  # another rank lives
    fault.strike_if_due(1, "joined")  # the first replacement is due at its start, not later
    assert not mark.exists()
    env = {**os.environ, START_FAULT_ENV: f"rank=1,after={died},when=start+joined,mark={mark}"}
    for call in ("on_start(N(world_rank=1))", "on_attempt(N(world_rank=1), 1, None)"):
        start = ("from types import SimpleNamespace as N; from raytrain_ddp.worker.hooks import load_hooks; "
                 f"load_hooks().{call}")  # as a worker loads them: by the file named in RAYTRAIN_DDP_HOOKS
        killed = subprocess.run([sys.executable, "-c", start + "; print('alive')"], env=env, capture_output=True,
                                text=True, timeout=60)
        assert killed.returncode == -signal.SIGKILL and "alive" not in killed.stdout, (call, killed.stderr[-500:])
        fault.strike_if_due(1, "start")  # after the death at start, the next is due only once joined
    assert len(mark.read_text().splitlines()) == 2
    fault.strike_if_due(1, "start"), fault.strike_if_due(1, "joined")  # every phase had its death: replacements live


def test_workers_reach_the_lighthouse_at_the_address_it_is_bound_to(monkeypatch):
    """torchft's lighthouse advertises the host name; our launcher names the bound address."""
    from raytrain_ddp.recovery.live_group import LIGHTHOUSE_ENV, LIGHTHOUSE_HOST_ENV, lighthouse_address

    monkeypatch.setenv(LIGHTHOUSE_ENV, "http://head-node:29510")
    monkeypatch.delenv(LIGHTHOUSE_HOST_ENV, raising=False)
    assert lighthouse_address() == "http://head-node:29510"  # not our launcher: as Ray said
    monkeypatch.setenv(LIGHTHOUSE_HOST_ENV, "10.0.0.7")
    assert lighthouse_address() == "http://10.0.0.7:29510"
    monkeypatch.setenv(LIGHTHOUSE_HOST_ENV, "fd00::7")
    assert lighthouse_address() == "http://[fd00::7]:29510"
    assert driver_live.worker_env("10.0.0.7") == {LIGHTHOUSE_HOST_ENV: "10.0.0.7"}


def test_managers_listen_on_loopback_with_an_embedded_lighthouse_else_on_their_node(monkeypatch):
    from raytrain_ddp.recovery.live_group import LIGHTHOUSE_HOST_ENV, node_address

    monkeypatch.setenv("MASTER_ADDR", "192.0.2.2")  # Ray's node address (it rewrites 127.0.0.1 to it)
    monkeypatch.setenv(LIGHTHOUSE_HOST_ENV, "127.0.0.1")
    assert node_address() == "127.0.0.1"
    monkeypatch.setenv(LIGHTHOUSE_HOST_ENV, "10.0.0.7")  # a cluster: the head's IP; this worker's node
    assert node_address() == "192.0.2.2"
    monkeypatch.delenv(LIGHTHOUSE_HOST_ENV)
    assert node_address() == "192.0.2.2"


def test_rewind_restores_the_cuda_generator_from_capture_rngs_index_and_state(monkeypatch):
    """#41 bug 1: `capture_rng` gives CUDA's state as (device index, state); rewind passes the state
    (a ByteTensor) to `torch.cuda.set_rng_state` for that index, not the pair (CPU-run: torch.cuda stubbed)."""
    from raytrain_ddp import checkpoint as ckpt

    cuda_state = torch.zeros(16, dtype=torch.uint8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: cuda_state.clone())
    restored: list[tuple] = []

    def set_rng_state(new_state, device="cuda"):
        if not isinstance(new_state, torch.Tensor):  # what torch does with anything but a ByteTensor
            raise TypeError(f"expected a ByteTensor, got {type(new_state).__name__}")
        restored.append((new_state, device))

    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    captured = ckpt.capture_rng(torch.device("cuda", 1))
    assert captured[3][0] == 1
    last = SimpleNamespace(buffers={}, rng=captured, device=torch.device("cuda", 1))
    module = torch.nn.Linear(2, 2)
    rewind(SimpleNamespace(optimizer=torch.optim.SGD(module.parameters(), lr=0.1), last_step=last,
                           module=module, scaler=torch.amp.GradScaler("cpu", enabled=False)))
    assert len(restored) == 1 and torch.equal(restored[0][0], cuda_state) and restored[0][1] == 1
