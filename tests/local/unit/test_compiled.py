"""model.activation_checkpointing and train.compile (worker/compiled.py), one process: each switch
fails a test when silently ignored (activations kept; a module that ran eagerly), and changes
no number (the same gradients, bf16 autocast included); their refusals are one line.
Two ranks, every strategy against torch DDP: tests/local/parallel/test_verify.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from raytrain_ddp.config import ConfigError, load_config
from raytrain_ddp.errors import UserError
from raytrain_ddp.models import MLP, Checkpointed, TinyGPT, checkpoint_activations
from raytrain_ddp.parallel import registry, wrap_model
from raytrain_ddp.timeline import Timeline, WorkerStamps
from raytrain_ddp.worker.compiled import CompileClock, compile_wrapper

pytestmark = pytest.mark.timeout(120)


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=50, seq_len=16, d_model=32, n_layers=2, n_heads=4, dropout=0.1)


def _step(model: nn.Module, tokens: torch.Tensor, dtype=None) -> tuple[int, list[torch.Tensor]]:
    """(tensors autograd saved for backward, the gradients) of one forward and backward."""
    saved = [0]

    def pack(t):
        saved[0] += 1
        return t

    torch.manual_seed(1)  # the same dropout masks
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=dtype) if dtype else torch.autocast("cpu", enabled=False):
            loss = model(tokens).float().logsumexp(-1).mean()
    loss.backward()
    return saved[0], [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_checkpointed_blocks_keep_fewer_activations_same_gradients_same_names(dtype):
    plain, checkpointed = _gpt(), _gpt()
    names = list(plain.state_dict())
    assert checkpoint_activations(checkpointed, "auto") == 2
    assert all(isinstance(b, Checkpointed) for b in checkpointed.blocks)
    assert list(checkpointed.state_dict()) == names  # checkpoints load either way
    assert [n for n, _ in checkpointed.named_parameters()] == [n for n, _ in plain.named_parameters()]
    tokens = torch.randint(0, 50, (4, 16))
    kept, grads = _step(plain, tokens, dtype)
    kept_ckpt, grads_ckpt = _step(checkpointed, tokens, dtype)
    assert kept_ckpt < kept / 2, (kept_ckpt, kept)  # ignored: as many saved tensors as without
    for a, b in zip(grads, grads_ckpt):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    checkpointed.eval()
    assert not checkpointed.blocks[0].block.training and not checkpointed.blocks[0].block.attn.training
    checkpointed.load_state_dict(plain.state_dict())  # a plain model's checkpoint loads


def test_classes_by_name_or_import_path_outermost_only_and_refusals():
    model = _gpt()
    assert checkpoint_activations(model, ["Block", "Linear"]) == 3  # 2 blocks (their Linears inside) + head
    assert isinstance(model.head, Checkpointed)
    assert checkpoint_activations(_gpt(), ["raytrain_ddp.models:Block"]) == 2
    assert checkpoint_activations(_gpt(), None) == 0
    mlp = MLP(8, [16], 4)
    with pytest.raises(UserError, match=r"model.activation_checkpointing='auto': MLP has no transformer blocks of the built-in gpt"):
        checkpoint_activations(mlp, "auto")
    with pytest.raises(UserError, match="MLP has no submodule of class Conv2d"):
        checkpoint_activations(mlp, ["Conv2d"])
    with pytest.raises(UserError, match="model.activation_checkpointing='raytrain_ddp.models:nothing'"):
        checkpoint_activations(mlp, ["raytrain_ddp.models:nothing"])


def test_config_keys_and_their_refusals():
    cfg = load_config(None, ["train.compile=max-autotune", "train.compile_backend=aot_eager",
                             "model.activation_checkpointing=[Block, 'pkg.mod:Layer']"])
    assert cfg.train.compile == "max-autotune" and cfg.model.activation_checkpointing == ["Block", "pkg.mod:Layer"]
    assert load_config(None, []).train.compile is False and load_config(None, []).model.activation_checkpointing is None
    for override, match in (("train.compile=fastest", "train.compile"),
                            ("model.activation_checkpointing=[]", "at least one module class"),
                            ("model.activation_checkpointing=['a b']", "neither a class name"),
                            ("model.activation_checkpointing=everything", "activation_checkpointing")):
        with pytest.raises(ConfigError, match=match):
            load_config(None, [override])
    refused = [name for name in registry.NAMES if name not in registry.COMPILERS]
    for name in refused:
        with pytest.raises(ConfigError, match=f"train.compile is not supported with parallel.strategy='{name}'"):
            load_config(None, [f"parallel.strategy={name}", "train.compile=true"])


@pytest.mark.parametrize("strategy", registry.COMPILERS)
def test_compiled_module_runs_the_backend_and_matches_eager(strategy):
    eager, compiled = _gpt(), _gpt()
    cfg = load_config(None, ["train.compile=true", "train.compile_backend=aot_eager"])
    wrapper = wrap_model(compiled, strategy)
    clock = compile_wrapper(wrapper, cfg)
    tokens = torch.randint(0, 50, (4, 16))
    _, want = _step(eager, tokens)
    _, got = _step(wrapper, tokens)
    assert clock.graphs >= 1 and clock.seconds > 0  # ignored: the backend never called
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert compile_wrapper(wrapper, load_config(None, [])) is None
    with pytest.raises(UserError, match="train.compile_backend='nope' is not a torch.compile backend"):
        CompileClock("nope", None)


def test_compile_is_its_own_start_up_phase():
    timeline = Timeline("f", started=0.0, entered=0.0)
    for phase in ("cli", "ray", "datasets"):
        timeline.mark(phase, applies=False)
    sent = []

    class Outbox:
        def send(self, kind, **fields):
            sent.append(fields)

    stamps = WorkerStamps(enabled=True)
    stamps.stamps.update(data_ready=1.0, model_built=2.0, state_restored=3.0)
    stamps.first_step_done(Outbox(), compile_s=4.5)
    sent[0]["stamps"]["first_step"] = 9.0
    timeline.worker(1, sent[0]["stamps"])
    phases = timeline.summary()["attempts"][0]["phases"]
    assert phases["compile"] == pytest.approx(4.5) and phases["first_step"] == pytest.approx(1.5)


def test_a_model_dynamo_skips_is_said_once_not_trained_as_if_compiled(capsys):
    from raytrain_ddp.worker.context import Rank

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))  # forward: torch's own code
    clock = CompileClock("aot_eager", None)
    model.compile(backend=clock)
    model(torch.randn(2, 4)).sum().backward()
    rank = Rank(0, 1, 0, torch.device("cpu"))
    assert clock.first_step_seconds(rank) == 0.0 and clock.first_step_seconds(rank) == 0.0
    said = capsys.readouterr().out
    assert said.count("train.compile: torch compiled no graph") == 1, said


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _attempt(run_dir, node_disk, monkeypatch, overrides) -> tuple[CompileClock, int, list[torch.Tensor]]:
    """One worker start on a node whose disk cache is `node_disk`: the caches loaded from the run
    directory, one compiled step, rank 0's save; (its clock, the cache hits, the gradients)."""
    from raytrain_ddp.parallel import torch_compat
    from raytrain_ddp.worker.context import Rank

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(node_disk))
    torch.compiler.reset()  # a new process: nothing compiled in memory
    wrapper = wrap_model(_Tiny(), "naive")
    clock = compile_wrapper(wrapper, load_config(None, ["train.compile=true", *overrides]))
    rank = Rank(0, 1, 0, torch.device("cpu"))
    clock.use_cache(run_dir, rank)
    hits = torch_compat.compile_cache_hits()
    wrapper(torch.ones(4, 8)).square().sum().backward()
    clock.first_step_seconds(rank)
    return clock, torch_compat.compile_cache_hits() - hits, [p.grad for p in wrapper.module.parameters()]


@pytest.mark.timeout(400)
def test_a_restart_on_a_new_node_reads_torchs_compile_cache_from_the_run_directory(tmp_path, monkeypatch, capsys):
    """inductor (a C++ compile on CPU, ~1 min under load: the lighter backends fill no cache) once
    cold, then a new node (its disk cache empty) loads the run directory's compile-cache.bin and
    hits; a garbage file (aot_eager: only the load is under test) is said and trains eagerly right."""
    from raytrain_ddp.rundir import COMPILE_CACHE_FILE, Location

    run_dir = Location.parse(tmp_path / "run")
    eager = _Tiny()
    eager(torch.ones(4, 8)).square().sum().backward()
    want = [p.grad for p in eager.parameters()]
    cold, cold_hits, cold_grads = _attempt(run_dir, tmp_path / "node1", monkeypatch, [])
    assert cold.loaded == 0 and cold_hits == 0 and cold.graphs == 1  # forward and backward: one graph for dynamo
    assert (run_dir / COMPILE_CACHE_FILE).exists()  # rank 0 saved what it compiled
    warm, warm_hits, warm_grads = _attempt(run_dir, tmp_path / "node2", monkeypatch, [])
    assert warm.loaded >= 2 and warm_hits >= 2, (warm.loaded, warm_hits)  # ignored: a cold compile, 0 hits
    for grads in (cold_grads, warm_grads):
        for a, b in zip(want, grads):
            torch.testing.assert_close(a, b)
    (run_dir / COMPILE_CACHE_FILE).write_bytes(b"not torch's")
    stale, _, stale_grads = _attempt(run_dir, tmp_path / "node3", monkeypatch, ["train.compile_backend=aot_eager"])
    assert stale.loaded == 0 and stale.graphs >= 1 and "compile-cache.bin not loaded" in capsys.readouterr().out
    for a, b in zip(want, stale_grads):
        torch.testing.assert_close(a, b)
