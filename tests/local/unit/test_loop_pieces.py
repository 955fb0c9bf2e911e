"""The loop's pieces without Ray: one optimizer step, non-finite handling, validation,
checkpoint state round trip (components), resume resolution and the test hooks.

A world-size-1 gloo group (file store, no ports) stands in for Ray Train's process group.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

from raytrain_ddp import checkpoint as ckpt
from raytrain_ddp.config import load_config
from raytrain_ddp.driver.resume import ResumeError, resolve_resume
from raytrain_ddp.driver.stream import Mailbox
from raytrain_ddp.job import DataSpec, Job
from _hooks import ENABLE, FaultPlan, TestHooks
from raytrain_ddp.worker.context import Rank
from raytrain_ddp.worker.hooks import HOOKS_ENV, Hooks, load_hooks
from raytrain_ddp.worker.meter import RunLog
from raytrain_ddp.worker.state import build_state
from raytrain_ddp.worker.step import NonFiniteAbort, train_step, validate

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(60)]

SPEC = DataSpec("classification", (8,), 3, 64, 16, "test")
RANK = Rank(world_rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.barrier()
    dist.destroy_process_group()


def _cfg(*overrides):
    return load_config(None, ["model.name=mlp", "model.hidden_sizes=[16]", "train.global_batch_size=8",
                              "train.micro_batch_size=4", "scaling.num_workers=1", "parallel.strategy=naive",
                              *overrides])


def _window(seed=0, poison=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g) * poison, torch.randint(0, 3, (4,), generator=g)) for _ in range(2)]


def _build(cfg, tmp="/nonexistent"):
    return build_state(Job(cfg=cfg, spec=SPEC, run_dir=str(tmp), fit_id="f" * 32), RANK, total_steps=10)


def _params(state):
    """The trainable parameters of a built state's model."""
    return [p for p in state.wrapper.module.parameters() if p.requires_grad]


def test_train_step_returns_window_mean_loss_and_steps(group):
    cfg = _cfg()
    parts = _build(cfg)
    window = _window()
    with torch.no_grad():
        expected = sum(parts.batch.run(parts.module, (x, y))[1].item() for x, y in window) / 2
    before = [p.detach().clone() for p in _params(parts)]
    result = train_step(parts, window, 2, cfg.train, RANK)
    assert result.loss == pytest.approx(expected, rel=1e-5) and result.lr == pytest.approx(cfg.train.lr)
    assert any(not torch.equal(a, b) for a, b in zip(before, _params(parts)))
    assert all(p.grad is None for p in _params(parts))  # zeroed for the next window
    assert parts.schedule.last_step == 1 and parts.progress.nonfinite_steps == 0
    assert parts.progress.step == 1  # the step counts itself, under the update lock


def test_nonfinite_loss_skips_the_step_then_aborts_after_max_consecutive(group):
    cfg = _cfg("train.nonfinite.max_consecutive=2")
    parts = _build(cfg)
    progress = parts.progress
    before = [p.detach().clone() for p in _params(parts)]
    result = train_step(parts, _window(poison=math.nan), 2, cfg.train, RANK)
    assert math.isnan(result.loss) and progress.nonfinite_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, _params(parts)))  # skipped
    train_step(parts, _window(1), 2, cfg.train, RANK)  # a good step resets the streak
    assert progress.consecutive_nonfinite == 0 and progress.nonfinite_steps == 1
    train_step(parts, _window(2, poison=math.nan), 2, cfg.train, RANK)
    with pytest.raises(NonFiniteAbort, match="2 in a row.*train.lr"):
        train_step(parts, _window(3, poison=math.inf), 2, cfg.train, RANK)

    abort_cfg = _cfg("train.nonfinite.action=abort")
    with pytest.raises(NonFiniteAbort, match="action=abort"):
        train_step(_build(abort_cfg), _window(poison=math.nan), 2, abort_cfg.train, RANK)


class _ValData:
    def __init__(self, batches):
        self.batches = batches

    def val_batches(self):
        return iter(self.batches)


def test_validate_sums_loss_and_accuracy_over_all_batches(group):
    cfg = _cfg()
    parts = _build(cfg)
    batches = _window() + [(torch.randn(3, 8), torch.tensor([0, 1, 2]))]
    with torch.no_grad():
        outs = [(parts.module(x), y) for x, y in batches]
    n = sum(len(y) for _, y in outs)
    loss = sum(parts.batch.loss(o, (None, y)).item() * len(y) for o, y in outs) / n
    acc = sum((o.argmax(-1) == y).sum().item() for o, y in outs) / n
    out = validate(parts, _ValData(batches), RANK, SPEC)
    assert out["val_loss"] == pytest.approx(loss, rel=1e-6) and out["val_accuracy"] == pytest.approx(acc)
    assert validate(parts, _ValData([]), RANK, SPEC) == {}


def test_validate_adds_the_users_metrics_and_lm_perplexity(group):
    """train.metrics: a per-batch mean counts the batch's rows, a (sum, count) pair is summed
    as is; both agree with the built-in accuracy over batches of different sizes. An lm's
    val_perplexity is exp(val_loss)."""
    cfg = _cfg()
    parts = _build(cfg)

    def metrics(output, batch):
        pred = output.argmax(-1)
        return {"err": (pred != batch[1]).float().mean(), "hits": ((pred == batch[1]).sum(), len(batch[1]))}

    parts.batch = dataclasses.replace(parts.batch, user_metrics=metrics)
    batches = _window() + [(torch.randn(3, 8), torch.tensor([0, 1, 2]))]
    out = validate(parts, _ValData(batches), RANK, SPEC)
    assert out["val_err"] == pytest.approx(1 - out["val_accuracy"], abs=1e-7)  # the user's float32 mean
    assert out["val_hits"] == pytest.approx(out["val_accuracy"], abs=1e-12)
    assert "val_perplexity" not in out
    lm = validate(parts, _ValData(batches), RANK, dataclasses.replace(SPEC, task="lm"))
    assert lm["val_perplexity"] == pytest.approx(math.exp(lm["val_loss"]), rel=1e-12)


def test_metric_sums_takes_means_and_pairs_and_names_what_is_wrong():
    from raytrain_ddp.batch import metric_sums

    sums = metric_sums({"m": torch.tensor(0.5), "p": (torch.tensor(3), 4), "f": 0.25}, rows=8)
    assert {k: (float(a), float(b)) for k, (a, b) in sums.items()} == {"m": (4.0, 8.0), "p": (3.0, 4.0), "f": (2.0, 8.0)}
    for values, message in [([1.0], "returned a list"), ({"a b": 1.0}, "must be an identifier"),
                            ({"loss": 1.0}, "built-in val_loss"), ({"p": (1, 2, 3)}, "must be \\(sum, count\\)"),
                            ({"v": torch.ones(2)}, "shape \\(2,\\)"), ({"s": "high"}, "is a str")]:
        with pytest.raises(ValueError, match=message):
            metric_sums(values, rows=8)


def test_accuracy_from_tensors_dicts_and_hugging_face_outputs():
    """Classification and token accuracy, whatever holds the logits; None where it does not apply."""
    from transformers.modeling_outputs import CausalLMOutput, SequenceClassifierOutput

    from raytrain_ddp.batch import BatchFormat
    from raytrain_ddp.worker.step import accuracy_counts, shifts_labels

    logits, y = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 1.0]]), torch.tensor([0, 1, 1])
    for output in (logits, {"logits": logits, "loss": torch.tensor(0.3)},
                   SequenceClassifierOutput(loss=torch.tensor(0.3), logits=logits)):
        correct, scored = accuracy_counts(output, y, "classification")
        assert (int(correct), scored) == (2, 3)
    assert accuracy_counts({"loss": torch.tensor(0.3)}, y, "classification") is None  # no logits
    assert accuracy_counts(logits, y.float(), "classification") is None  # a regression target
    assert accuracy_counts(logits, y, "other") is None

    # lm: (rows, tokens, vocab) against (rows, tokens), -100 not scored
    tokens = torch.tensor([[1, 2, 3, 0]])
    lm_logits = torch.nn.functional.one_hot(torch.tensor([[1, 2, 0, 0]]), 4).float()  # predicts 1 2 0 0
    correct, scored = accuracy_counts(lm_logits, tokens, "lm")
    assert (int(correct), scored) == (3, 4)
    correct, scored = accuracy_counts(lm_logits, torch.tensor([[1, 2, -100, -100]]), "lm")
    assert (int(correct), scored) == (2, 2)
    # a Hugging Face causal LM given labels=input_ids: logits at t predict the token at t + 1
    shifted_logits = torch.nn.functional.one_hot(torch.tensor([[2, 3, 0, 1]]), 4).float()
    correct, scored = accuracy_counts(CausalLMOutput(logits=shifted_logits), tokens, "lm", shifted=True)
    assert (int(correct), scored) == (3, 3)

    class GPT2LMHeadModel(torch.nn.Module):
        pass

    class BertForTokenClassification(torch.nn.Module):
        pass

    hf = BatchFormat(label="labels", inputs=("input_ids", "labels"), loss_name="model")
    assert shifts_labels(GPT2LMHeadModel(), hf) and not shifts_labels(BertForTokenClassification(), hf)
    assert not shifts_labels(GPT2LMHeadModel(), BatchFormat(label="labels", inputs=("input_ids",)))


class _Data:
    wait_seconds = 0.0


def test_checkpoint_is_one_entry_per_component_and_round_trips(group, tmp_path):
    cfg = _cfg()
    job = Job(cfg=cfg, spec=SPEC, run_dir=str(tmp_path), fit_id="f" * 32)
    parts = build_state(job, RANK, total_steps=10)
    for i in range(3):
        train_step(parts, _window(i), 2, cfg.train, RANK)  # counts the step
    parts.progress.next_epoch(0)
    parts.progress.steps_into_epoch = 1
    ckpt.save_checkpoint(tmp_path / "checkpoint_x", parts.state_dict())
    state = ckpt.load_checkpoint(tmp_path / "checkpoint_x")
    assert set(state) == {"model", "optimizer", "schedule", "progress", "rng", "run"}  # no scaler in fp32
    assert state["progress"] == {"step": 3, "epoch": 1, "steps_into_epoch": 1, "nonfinite_steps": 0}
    assert state["run"]["fit_id"] == job.fit_id and state["run"]["world_size"] == 1

    fresh = build_state(job, RANK, total_steps=10)
    fresh.load_state_dict(state)  # the model through `.module`, after wrapping
    p = fresh.progress
    assert (p.step, p.epoch, p.steps_into_epoch) == (3, 1, 1)
    assert fresh.schedule.last_step == 3 and fresh.optimizer.param_groups[0]["lr"] == parts.optimizer.param_groups[0]["lr"]
    for a, b in zip(_params(parts), _params(fresh)):
        assert torch.equal(a, b)
    # the same next step from both: optimizer moments were restored too
    train_step(parts, _window(9), 2, cfg.train, RANK)
    train_step(fresh, _window(9), 2, cfg.train, RANK)
    for a, b in zip(_params(parts), _params(fresh)):
        assert torch.allclose(a, b)
    job = dataclasses.replace(job, mailbox=Mailbox())  # the driver's mailbox, in process
    assert RunLog(job, RANK, parts, _Data(), 10).attempt == 1 and RunLog(job, RANK, parts, _Data(), 10).attempt == 2


def test_rank0_says_the_auto_layout_once_it_is_chosen(group, capsys):
    """parallel.bucket_cap_mb=auto: the wrapper decides after its tuning steps; RunLog prints it once."""
    cfg = _cfg()
    parts = _build(cfg)
    log = RunLog(Job(cfg=cfg, spec=SPEC, run_dir="/nonexistent", fit_id="f" * 32), RANK, parts, _Data(), 10)
    result = train_step(parts, _window(), 2, cfg.train, RANK)
    log.step(result, False)  # not decided yet: nothing said
    parts.wrapper.tuning = {"text": "1.1 MB (5 buckets); synced backward ms ..."}
    for _ in range(2):
        parts.progress.step_done()
        log.step(result, False)
    said = [line for line in capsys.readouterr().out.splitlines() if "auto tuning" in line]
    assert said == ["[rank 0] parallel auto tuning at step 2: 1.1 MB (5 buckets); synced backward ms ..."]


def test_resolve_resume_modes(tmp_path):
    run_dir = tmp_path / "run"
    assert resolve_resume(_cfg(), run_dir) is None  # fresh
    with pytest.raises(ResumeError, match="run.resume=latest.*no valid checkpoint"):
        resolve_resume(_cfg("run.resume=latest"), run_dir)
    state = {"model": {}, "optimizer": {}, "progress": {"step": 4, "epoch": 0, "steps_into_epoch": 4},
             "run": {"fit_id": "a"}}
    ckpt.save_checkpoint(run_dir / "checkpoint_4", state)
    ckpt.save_checkpoint(run_dir / "checkpoint_8", {**state, "progress": {**state["progress"], "step": 8}})
    (run_dir / "checkpoint_8" / "state.pt").write_bytes(b"garbage")  # damaged newest
    assert resolve_resume(_cfg(), run_dir) == run_dir / "checkpoint_4"
    assert resolve_resume(_cfg("run.resume=latest"), run_dir) == run_dir / "checkpoint_4"
    assert resolve_resume(_cfg(f"run.resume={run_dir / 'checkpoint_4'}"), run_dir) == run_dir / "checkpoint_4"
    with pytest.raises(ResumeError, match=r"checkpoint_8/state\.pt"):
        resolve_resume(_cfg(f"run.resume={run_dir / 'checkpoint_8'}"), run_dir)
    with pytest.raises(ResumeError, match="run.resume=never.*already exists"):
        resolve_resume(_cfg("run.resume=never"), run_dir)


def test_hooks_are_a_no_op_unless_named_and_test_hooks_fire_only_where_asked(monkeypatch):
    monkeypatch.delenv(HOOKS_ENV, raising=False)
    assert type(load_hooks()) is Hooks
    monkeypatch.setenv(HOOKS_ENV, ENABLE[HOOKS_ENV])
    monkeypatch.delenv("RAYTRAIN_DDP_FAULT", raising=False)
    assert isinstance(load_hooks(), TestHooks) and FaultPlan.from_env() is None
    monkeypatch.setenv("RAYTRAIN_DDP_FAULT", "rank=0,step=3,attempt=2,mode=raise")
    plan = FaultPlan.from_env()
    assert plan == FaultPlan(rank=0, step=3, attempt=2, mode="raise")
    hooks = TestHooks(plan)
    hooks.on_attempt(RANK, 1, torch.nn.Linear(2, 2))
    hooks.after_step(3)  # other attempt: nothing
    hooks.on_attempt(RANK, 2, torch.nn.Linear(2, 2))
    hooks.after_step(2)  # other step: nothing
    with pytest.raises(RuntimeError, match="injected fault"):
        hooks.after_step(3)
    module = torch.nn.Linear(2, 2)
    nan_hooks = TestHooks(FaultPlan(rank=0, step=5, attempt=1, mode="nan"))
    nan_hooks.on_attempt(RANK, 1, module)
    nan_hooks.after_step(3)
    assert torch.isfinite(module(torch.ones(1, 2))).all()  # step 4 is clean
    nan_hooks.after_step(4)
    assert torch.isnan(module(torch.ones(1, 2))).all()  # step 5's forward is poisoned
    assert torch.isfinite(module.eval()(torch.ones(1, 2))).all()  # validation is not
    monkeypatch.setenv("RAYTRAIN_DDP_FAULT", "step=1,mode=explode")
    with pytest.raises(ValueError, match="mode must be"):
        FaultPlan.from_env()


def test_the_sample_log_has_each_step_s_rows_and_each_forward_s_at_once(monkeypatch, tmp_path):
    import json

    monkeypatch.setenv("RAYTRAIN_DDP_SAMPLE_LOG", str(tmp_path))
    hooks, module = TestHooks(), torch.nn.Linear(2, 2)
    hooks.on_attempt(RANK, 1, module)
    hooks.before_step(7)
    module(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))  # two micro-batches of step 7
    module(torch.tensor([[5.0, 6.0]]))
    pending = [json.loads(x) for f in tmp_path.glob("pending-rank0-*.jsonl") for x in f.read_text().splitlines()]
    assert [(x["step"], len(x["rows"])) for x in pending] == [(7, 2), (7, 1)]  # there before the step ends
    assert not list(tmp_path.glob("samples-*.jsonl"))
    module.eval()(torch.ones(1, 2))  # validation: not a training row
    hooks.after_step(7)
    (done,) = [json.loads(x) for f in tmp_path.glob("samples-rank0-*.jsonl") for x in f.read_text().splitlines()]
    assert done["step"] == 7 and done["rows"] == pending[0]["rows"] + pending[1]["rows"]


def test_bf16_autocast_step_on_cpu_and_sgd_with_clipping(group):
    cfg = _cfg("train.precision=bf16", "train.optimizer=sgd", "train.clip_grad_norm=0.01")
    parts = _build(cfg)
    before = [p.detach().clone() for p in _params(parts)]
    result = train_step(parts, _window(), 2, cfg.train, RANK)
    assert math.isfinite(result.loss) and not parts.scaler.is_enabled()
    moved = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(before, _params(parts))))
    # one SGD step from zero momentum with a clipped gradient moves at most lr * max_norm
    assert 0 < moved <= cfg.train.lr * 0.01 * (1 + 1e-3)


def test_survivors_copy_is_the_last_completed_step_whatever_the_failed_step_moved(group, tmp_path):
    """#15: after a step fails part-way, a rank's copy equals a checkpoint taken at the last boundary."""
    from raytrain_ddp.errors import UserError
    from raytrain_ddp.rundir import Location
    from raytrain_ddp.recovery.replica import LastStep, is_peer_loss, write_last_step, written_by_survivor

    cfg = _cfg()
    parts = _build(cfg, tmp_path)
    for i in range(2):
        train_step(parts, _window(i), 2, cfg.train, RANK)
    at_boundary = parts.state_dict()
    torch.randn(100)  # the failed step's forward consumed randomness ...
    where, _ = write_last_step(parts.last_step_state_dict(), Location.parse(tmp_path), "f" * 32, world_rank=1)
    assert where.name == "checkpoint_00000002_e0s2_ffffffff_r1"
    copy = ckpt.load_checkpoint(where.local_path)
    assert written_by_survivor(ckpt.read_manifest(where.local_path)) == 1
    assert copy["progress"] == at_boundary["progress"] and torch.equal(copy["rng"]["torch"], at_boundary["rng"]["torch"])
    assert all(torch.equal(copy["model"][k], v) for k, v in at_boundary["model"].items())

    # ... and moved BatchNorm's running statistics: the copy has the boundary's, the module keeps its own
    bn = torch.nn.BatchNorm1d(4)
    kept = LastStep(bn)
    bn(torch.randn(8, 4) + 3)
    moved = bn.running_mean.clone()
    copied = kept.on_cpu(kept.with_buffers(bn.state_dict()))
    assert torch.equal(copied["running_mean"], torch.zeros(4)) and int(copied["num_batches_tracked"]) == 0
    assert torch.equal(bn.running_mean, moved) and not torch.equal(moved, torch.zeros(4))
    kept.mark()
    assert torch.equal(kept.on_cpu(kept.with_buffers(bn.state_dict()))["running_mean"], moved)

    # an optimizer step in progress (the update lock held) is waited for, then given up on
    with parts.lock:
        assert parts.last_step_state_dict(timeout_s=0.1) is None

    # only a collective's failure is a lost peer: raised from a frame of torch.distributed's
    import torch.distributed.distributed_c10d as c10d

    scope: dict = {}
    exec(compile("def boom():\n    raise RuntimeError('Connection reset by peer')", c10d.__file__, "exec"), scope)
    try:
        scope["boom"]()
    except RuntimeError as exc:
        assert is_peer_loss(exc)
    for own in (RuntimeError("a bug in the user's forward"), UserError("bad key"), NonFiniteAbort("nan")):
        try:
            raise own
        except Exception as exc:  # noqa: BLE001
            assert not is_peer_loss(exc)


def test_ray_stopping_a_worker_waits_for_its_copy_or_writes_one_for_a_blocked_loop():
    import threading
    import time

    from raytrain_ddp.recovery.replica import CopyWindow

    window, written = CopyWindow(), []
    window.attach(written.append)
    started = time.monotonic()
    # the loop is blocked (a Ray barrier, an NCCL collective): after start_s, Ray's thread writes
    assert window.on_shutdown(start_s=0.2, finish_s=5) == "training" and len(written) == 1
    assert 0.15 < time.monotonic() - started < 2

    window, written = CopyWindow(), []
    window.attach(written.append)
    window.enter("writing")  # the loop's own copy is under way: wait for it, write nothing
    threading.Timer(0.3, window.enter, args=("ended",)).start()
    started = time.monotonic()
    assert window.on_shutdown(start_s=1, finish_s=5) == "ended" and written == []
    assert 0.2 < time.monotonic() - started < 3


def test_checkpoint_every_epochs_saves_every_nth_epoch_end_the_last_step_and_a_signalled_one():
    """`run.checkpoint_every_epochs` (#57): the rule the loop asks at each epoch end (0-based epochs)."""
    from types import SimpleNamespace

    from raytrain_ddp.worker.checkpointer import Checkpointer

    every = SimpleNamespace(every_epochs=5, _signalled_at_epoch_end=False)
    assert [e for e in range(12) if Checkpointer.epoch_end_due(every, e, last=False)] == [4, 9]
    assert Checkpointer.epoch_end_due(every, 6, last=True)  # the run's last step: always
    every._signalled_at_epoch_end = True  # a preemption signal at the epoch's last step: saved there
    assert Checkpointer.epoch_end_due(every, 6, last=False)
