"""The one typed configuration tree for a training run: every key, its type, default and docstring.

Owns: the schema (one pydantic section per concern, `Config` the whole run) and the
checks of single keys. Cross-field checks live in `checks.py`, loading YAML and
overrides in `load.py`, the docs table in `reference.py`. Must not touch: Ray, torch,
the filesystem. Checks that need the data (schema, row counts) live in `raytrain_ddp.data.sources`; this
package only knows shapes of numbers. Strategy names come from `parallel/registry.py`.

Every error is a `ConfigError` (or a pydantic error turned into one by `load.py`) whose
message names the offending key, the value given and what is allowed, so the CLI can
print it without a traceback.
"""

# Over 500 lines: the whole schema in one file, every key with the description docs/configuration.md is generated from.
from __future__ import annotations

import re
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from raytrain_ddp.config import checks
from raytrain_ddp.errors import UserError
from raytrain_ddp.parallel import registry


class ConfigError(UserError, ValueError):
    """A configuration problem, phrased for the user: key, value, what is allowed."""


class _Section(BaseModel):
    """Strict base: unknown keys are errors, assignments are re-validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


BUILTIN_MODELS = ("mlp", "cnn", "gpt")
BUILTIN_LOSSES = ("cross_entropy", "model")
BUILTIN_OPTIMIZERS = ("adamw", "sgd")
BUILTIN_SCHEDULES = ("cosine", "linear", "constant")
# "package.module:attribute": what `raytrain_ddp.user` imports (the callables of
# `raytrain_ddp.train(...)` are recorded the same way, so `<lambda>` and `<locals>` pass).
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[\w.<>]+$")


def _import_path_or(value: str, builtins: tuple[str, ...], what: str) -> str:
    if value in builtins or _IMPORT_PATH.match(value):
        return value
    allowed = f"one of {', '.join(builtins)} or an import path" if builtins else "an import path"
    raise ValueError(f"must be {allowed} 'package.module:{what}' (got {value!r})")


class ModelConfig(_Section):
    name: str = Field(
        "cnn", description="mlp: the articles' 1024-1024-1024-256 MLP; cnn: small conv net for "
        "8x8 images; gpt: tiny decoder-only transformer over token ids; or your own model as "
        "an import path 'package.module:factory', called as factory(spec, **model.kwargs) "
        "and returning a torch.nn.Module (docs/byo.md)."
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for your model factory (model.name an import path).",
    )
    hidden_sizes: list[int] = Field(
        [1024, 1024, 256],
        description="mlp only: widths after the input layer; the last is the output width "
        "unless the data has fewer classes, in which case a classifier head is added.",
    )
    d_model: int = Field(128, ge=8, description="gpt only: embedding width.")
    n_layers: int = Field(2, ge=1, description="gpt only: transformer blocks.")
    n_heads: int = Field(4, ge=1, description="gpt only: attention heads; must divide d_model.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout probability (all models).")
    activation_checkpointing: Optional[Union[Literal["auto"], list[str]]] = Field(
        None, description="Recompute the activations of these submodules in backward instead of keeping "
        "them (torch.utils.checkpoint, non-reentrant): less memory for a longer sequence or a bigger "
        "micro batch, at the cost of one more forward of each. A list of module classes, by class name "
        "or import path 'package.module:Class' (the outermost matches are wrapped; none matching is an "
        "error); auto: the built-in gpt's transformer blocks. Every strategy, accumulation and precision.",
    )

    @field_validator("name")
    @classmethod
    def _builtin_or_import_path(cls, value: str) -> str:
        return _import_path_or(value, BUILTIN_MODELS, "factory")

    @field_validator("activation_checkpointing")
    @classmethod
    def _classes(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise ValueError("list at least one module class (or use null, or auto)")
            for name in value:
                if not (_IMPORT_PATH.match(name) or re.match(r"^[A-Za-z_]\w*$", name)):
                    raise ValueError(f"{name!r} is neither a class name nor an import path 'package.module:Class'")
        return value

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "ModelConfig":
        if self.kwargs and self.name in BUILTIN_MODELS:
            raise ValueError(
                f"model.kwargs is for a model factory (model.name 'package.module:factory'); "
                f"the built-in {self.name!r} is configured by its own model.* keys"
            )
        if self.name == "gpt" and self.d_model % self.n_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} must divide model.d_model={self.d_model}"
            )
        return self


class SyntheticConfig(_Section):
    rows: int = Field(4096, ge=1, description="Rows to generate.")
    feature_dim: int = Field(1024, ge=1, description="Width of the feature vector (mlp/cnn).")
    num_classes: int = Field(256, ge=2, description="Label classes (mlp/cnn); vocab size for gpt.")
    seq_len: int = Field(64, ge=2, description="gpt only: tokens per row.")


class DataConfig(_Section):
    source: Literal["digits", "parquet", "synthetic", "datasets"] = Field(
        "digits", description="digits: scikit-learn's 1,797 real 8x8 images (no download); "
        "parquet: files at data.path; synthetic: generated rows (benchmarks); datasets: the "
        "Ray Datasets given to raytrain_ddp.train(datasets=...) (Python only)."
    )
    path: Optional[str] = Field(None, description="Parquet file or directory (source: parquet).")
    val_path: Optional[str] = Field(
        None, description="source: parquet: a fixed validation set (file or directory) instead "
        "of holding out data.val_fraction of data.path.",
    )
    features: str = Field("x", min_length=1, description="Column holding the inputs (list / tensor).")
    label: str = Field("y", min_length=1, description="Column holding the target (integer for cross_entropy).")
    task: Optional[Literal["classification", "regression"]] = Field(
        None, description="null: from data.label's type, on every route (integer class ids: classification; "
        "floats or vectors: regression, a target your loss takes as it is, as float32); set it to say so, e.g. "
        "regression for integer counts.",
    )
    inputs: Optional[list[str]] = Field(
        None, description="null: batches are (x, y) = (data.features, data.label) and the model "
        "is called as model(x); a list of columns: batches are dicts of named tensors (every "
        "column) and the model is called with these columns as keyword arguments, Hugging "
        "Face style (e.g. [input_ids, attention_mask]).",
    )
    preprocess: Optional[str] = Field(
        None, description="Import path 'package.module:function' of a batch function (dict of "
        "numpy arrays in, dict of numpy arrays out; may change the row count) that Ray Data "
        "runs with map_batches on its CPU tasks before training.",
    )
    val_fraction: float = Field(0.2, ge=0.0, lt=1.0, description="Share of rows held out for validation.")
    shuffle: bool = Field(True, description="Seeded shuffle every epoch (same on all ranks).")
    shuffle_buffer: Optional[int] = Field(
        None, ge=1,
        description="streaming sharding only: rows in Ray Data's local shuffle buffer "
        "instead of a global per-epoch shuffle.",
    )
    sharding: Literal["exact", "streaming", "sharded"] = Field(
        "exact",
        description="exact: every worker sees the same seeded global order and takes its "
        "slice of each global batch, so results do not depend on the worker count and "
        "resume is exact mid-epoch; streaming: Ray Data streaming_split (scales to data "
        "larger than a worker's memory; order depends on the worker count); sharded: the "
        "guarantees of exact for data larger than a worker's memory: the driver writes the "
        "split once (through Ray Data) as chunks of data.chunk_rows rows under the run "
        "directory, and each worker reads only its chunks of every step.",
    )
    chunk_rows: Optional[int] = Field(
        None, ge=1,
        description="sharded sharding only: rows per chunk, the unit each epoch's seeded "
        "shuffle permutes and a worker reads; must divide train.micro_batch_size. null: the "
        "largest divisor of the micro batch up to 64. Smaller: closer to a per-row shuffle, "
        "more reads.",
    )
    prefetch_batches: int = Field(
        2, ge=0,
        description="Batches read ahead of the step: Ray Data's prefetch onto the device (streaming); "
        "the reader thread's window (sharded, used once a step's read takes over 1 ms: object "
        "storage, cold disks). 0: read in the training thread.")
    synthetic: SyntheticConfig = Field(default_factory=SyntheticConfig)

    @field_validator("preprocess")
    @classmethod
    def _import_path(cls, value: Optional[str]) -> Optional[str]:
        return None if value is None else _import_path_or(value, (), "function")

    @model_validator(mode="after")
    def _path_matches_source(self) -> "DataConfig":
        if self.source == "parquet" and not self.path:
            raise ValueError("data.path is required when data.source is 'parquet'")
        if self.val_path and self.source != "parquet":
            raise ValueError(f"data.val_path needs data.source='parquet' (got {self.source!r})")
        if self.inputs is not None and (not self.inputs or not all(self.inputs)):
            raise ValueError("data.inputs must list at least one column name (or be null)")
        if self.chunk_rows is not None and self.sharding != "sharded":
            raise ValueError(
                f"data.chunk_rows only applies to data.sharding='sharded' (got sharding={self.sharding!r})"
            )
        if self.shuffle_buffer is not None and self.sharding != "streaming":
            raise ValueError(
                "data.shuffle_buffer only applies to data.sharding='streaming' "
                f"(got sharding={self.sharding!r})"
            )
        return self


class NonFiniteConfig(_Section):
    action: Literal["skip", "abort"] = Field(
        "skip", description="What every rank does when the loss or a gradient is inf/nan: "
        "skip the optimizer step, or abort the run."
    )
    max_consecutive: int = Field(
        3, ge=1, description="Abort after this many non-finite steps in a row, even with action=skip."
    )


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


class TrainConfig(_Section):
    epochs: int = Field(10, ge=1, description="Passes over the training set (unless max_steps is set).")
    max_steps: Optional[int] = Field(None, ge=1, description="Optimizer steps; overrides epochs when set.")
    global_batch_size: int = Field(64, ge=1, le=2**24, description="Samples per optimizer step, over all workers.")
    micro_batch_size: int = Field(16, ge=1, le=2**20, description="Samples per worker per micro-step (forward+backward).")
    loss: str = Field(
        "cross_entropy", description="cross_entropy: over data.label (per token for (B, T, V) "
        "outputs); model: the model returns its own loss (a scalar, or output.loss / "
        "output['loss'], Hugging Face style); or an import path 'package.module:function' "
        "called as loss(output, batch) -> scalar.",
    )
    optimizer: str = Field(
        "adamw", description="adamw; sgd with train.momentum; or your own as an import path "
        "'package.module:fn', called as fn(model, **train.optimizer_kwargs) -> torch.optim.Optimizer "
        "(its parameter groups are yours; docs/byo.md).",
    )
    optimizer_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for your optimizer function (train.optimizer an import path).",
    )
    no_decay: bool = Field(
        True, description="Built-in optimizers: no weight decay on biases and norm weights (every "
        "parameter of fewer than 2 dimensions), as transformer recipes do.",
    )
    lr: float = Field(0.003, gt=0.0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="Decoupled (adamw) or L2 (sgd) weight decay.")
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="sgd only.")
    schedule: str = Field(
        "cosine", description="cosine (warm-up, then cosine down to min_lr_ratio x lr), linear (warm-up, "
        "then linear down to it), constant (warm-up, then lr); or your own as an import path "
        "'package.module:fn', called as fn(optimizer, total_steps, **train.schedule_kwargs) -> "
        "torch.optim.lr_scheduler.LRScheduler, stepped once per optimizer step.",
    )
    schedule_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for your schedule function (train.schedule an import path).",
    )
    metrics: Optional[str] = Field(None, description="Your validation metrics, 'package.module:fn': fn(output, batch) "
        "-> {name: the batch's mean, or a (sum, count) pair}, summed exactly over every rank's validation rows "
        "and reported as val_<name>. Built in: val_accuracy (classification, lm), val_perplexity (lm).")
    warmup_steps: int = Field(0, ge=0, description="Built-in schedules: linear warm-up steps before the decay.")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Built-in schedules: the floor as a fraction of lr.")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="torch.amp autocast dtype; fp16 adds a GradScaler."
    )
    clip_grad_norm: Optional[float] = Field(None, gt=0.0, description="Global gradient-norm clip.")
    seed: int = Field(0, ge=0, description="Seeds model init, data order and the validation split.")
    compile: Union[bool, Literal[COMPILE_MODES]] = Field(  # type: ignore[valid-type]
        False, description="torch.compile the model, as its parallel.strategy needs: native compiles the "
        "DDP module (torch's DDPOptimizer splits the graph at the buckets), naive/bucketed/zero1 the "
        "bare module (their gradient hooks run after the compiled backward); fsdp: refused. true, or a "
        "mode of inductor's (" + ", ".join(COMPILE_MODES) + "). The first step pays the compilation "
        "(the start-up timeline's compile phase).",
    )
    compile_backend: str = Field(
        "inductor", min_length=1, description="train.compile's backend: inductor (torch's default), or "
        "any name torch.compiler.list_backends(exclude_tags=()) lists (aot_eager: no code generation, "
        "fast to compile; for checks).",
    )
    nonfinite: NonFiniteConfig = Field(default_factory=NonFiniteConfig)

    @field_validator("loss")
    @classmethod
    def _builtin_or_import_path(cls, value: str) -> str:
        return _import_path_or(value, BUILTIN_LOSSES, "function")

    @field_validator("optimizer")
    @classmethod
    def _optimizer(cls, value: str) -> str:
        return _import_path_or(value, BUILTIN_OPTIMIZERS, "fn")

    @field_validator("schedule")
    @classmethod
    def _schedule(cls, value: str) -> str:
        return _import_path_or(value, BUILTIN_SCHEDULES, "fn")

    @field_validator("metrics")
    @classmethod
    def _metrics(cls, value: Optional[str]) -> Optional[str]:
        return None if value is None else _import_path_or(value, (), "fn")

    @model_validator(mode="after")
    def _kwargs_only_for_user_code(self) -> "TrainConfig":
        for key, builtins in (("optimizer", BUILTIN_OPTIMIZERS), ("schedule", BUILTIN_SCHEDULES)):
            if getattr(self, f"{key}_kwargs") and getattr(self, key) in builtins:
                raise ValueError(f"train.{key}_kwargs is for your own {key} (train.{key} 'package.module:fn'); "
                                 f"the built-in {getattr(self, key)!r} is set by train.* keys")
        return self


class ParallelConfig(_Section):
    strategy: Literal[registry.NAMES] = Field(  # type: ignore[valid-type] - the registry's names
        registry.DEFAULT, description="naive/bucketed: our from-scratch wrappers; native: torch DDP; "
        "zero1: ZeRO stage 1 from scratch (each worker keeps 1/N of the optimizer state); fsdp: "
        "torch FSDP2 (parameters, gradients and optimizer state sharded). docs/parallel.md."
    )
    bucket_cap_mb: Union[float, Literal["auto"]] = Field(
        25.0, description="bucketed/native/zero1: bucket size in MB; fsdp: a submodule "
        "holding at least this many MB of parameters becomes its own FSDP unit. auto "
        "(bucketed): the first ~20 synced steps time a few sizes and keep the fastest for "
        "this model and network, the same on every worker (rank 0 prints the choice).",
    )
    first_bucket_mb: float = Field(
        1.0, gt=0.0, description="bucketed/native/zero1: cap of the first bucket in MB (the output "
        "layers, whose gradients backward produces first), as torch DDP's 1 MB: a small "
        "first bucket starts communication early.",
    )
    compress: Optional[Literal["bf16", "auto"]] = Field(
        None, description="Gradient compression on the wire (bucketed, native, zero1; fsdp: "
        "gradients reduced in bf16). auto (bucketed): tuning also times bf16 and keeps it "
        "only if it saves >= 3% (lossy: opt in).",
    )
    verify_init: bool = Field(
        False, description="Raise if ranks start from different weights instead of broadcasting rank 0's."
    )
    collective_timeout_s: float = Field(
        300.0, gt=0.0,
        description="A collective (all-reduce, barrier) that does not finish in this time "
        "fails the run with an error naming the operation, instead of hanging. GPUs (NCCL): "
        "the step never waits on the host; the stuck collective is named at this time and "
        "NCCL's watchdog ends the run at the process group's timeout (10% later, >= 30 s).",
    )
    broadcast_buffers: bool = Field(
        True, description="As torch DDP: before each forward that follows a synced one, every "
        "rank takes rank 0's buffers (BatchNorm running stats). false keeps per-rank buffers.",
    )
    find_unused_parameters: bool = Field(
        False, description="As torch DDP: allow parameters that get no gradient in a step (a "
        "branch not taken); they keep grad None where no rank used them. Off (the default), such "
        "a parameter fails the step with an error naming it; turn on only when needed (it costs "
        "one small all-reduce per step).",
    )
    shm: bool = Field(
        True, description="bucketed, CPU: when every worker is on one host, all-reduce gradients "
        "through shared memory (/dev/shm) instead of gloo's TCP: the same sums, less time "
        "(docs/parallel.md). Decided by all workers together at the first synced step; gloo "
        "wherever a worker cannot open the segment or /dev/shm is short of space.",
    )

    @field_validator("bucket_cap_mb", mode="before")
    @classmethod
    def _cap_or_auto(cls, value: Any) -> Any:
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError("must be a number of MB > 0, or auto")
        return float(value)


_MAX_WORKERS = 4096


class ScalingConfig(_Section):
    num_workers: Union[int, tuple[int, int]] = Field(
        2, description="Workers (one per GPU or CPU slot); [min, max] for an elastic run; 0: local "
        "mode, training in this process with no Ray at all (a breakpoint() reaches your terminal)."
    )
    use_gpu: bool = Field(False, description="One GPU per worker; NCCL instead of gloo.")
    cpus_per_worker: float = Field(1.0, gt=0.0, description="Logical CPUs reserved by each worker.")
    placement_strategy: Literal["PACK", "SPREAD"] = Field(
        "PACK", description="How Ray places the workers over the nodes: PACK (Ray Train's default) "
        "fills as few nodes as possible; SPREAD uses as many as it can, so a lost node takes fewer "
        "workers, and with run.recovery=live they are replaced on the capacity that is left "
        "(docs/reliability.md#node-loss).",
    )
    resize_interval_s: float = Field(
        300.0, ge=0.0,
        description="Elastic runs: how often Ray may grow the worker group when more workers "
        "fit. Each resize restarts from the latest checkpoint, so keep it well above the "
        "checkpoint interval.",
    )
    launcher: Literal["ray", "torchrun"] = Field(
        "ray", description="How the workers start: 'ray' (Ray Train's TorchTrainer places them, on "
        "one machine or a cluster) or 'torchrun' (this machine only: torch.distributed.run starts "
        "scaling.num_workers processes and no Ray at all, as Ray Train's local mode runs; the same "
        "loop, data and checkpoints, the same weights bit for bit; no fault tolerance, "
        "data.sharding=exact only; docs/usage.md#torchrun).",
    )
    placement_timeout_s: float = Field(
        600.0, ge=0.0,
        description="Seconds to wait for the cluster to place the worker group (a status line "
        "every 30 s says what is missing); then the run ends with status 'unschedulable'. "
        "Long enough for an autoscaler to start a node; 0 waits forever (batch jobs).",
    )

    @field_validator("num_workers", mode="before")
    @classmethod
    def _list_to_tuple(cls, value: Any) -> Any:
        if isinstance(value, list):
            return tuple(value)
        return value

    @field_validator("num_workers")
    @classmethod
    def _positive_workers(cls, value: Union[int, tuple[int, int]]) -> Union[int, tuple[int, int]]:
        if isinstance(value, tuple):
            lo, hi = value
            if lo < 1 or hi < lo or hi > _MAX_WORKERS:
                raise ValueError(f"[min, max] needs 1 <= min <= max <= {_MAX_WORKERS}, got [{lo}, {hi}]")
        elif not 0 <= value <= _MAX_WORKERS:
            raise ValueError(f"must be between 0 (local mode) and {_MAX_WORKERS}, got {value}")
        return value

    @property
    def elastic(self) -> bool:
        return isinstance(self.num_workers, tuple)

    @property
    def local(self) -> bool:
        """`num_workers: 0`: one process, which is the only rank (world size 1)."""
        return self.num_workers == 0

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if isinstance(self.num_workers, tuple) else max(1, self.num_workers)

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if isinstance(self.num_workers, tuple) else max(1, self.num_workers)


class ProfileConfig(_Section):
    start_step: int = Field(
        5, ge=1, description="First optimizer step (counted over the whole run) recorded by "
        "run.profile; the step before it is the profiler's warm-up.",
    )
    steps: int = Field(
        0, ge=0, description="Optimizer steps to record with torch.profiler on rank 0 "
        "(0: off); the trace goes to <run dir>/profile/ (docs/profiling.md).",
    )
    record_shapes: bool = Field(False, description="Record operator input shapes (larger trace).")


class RunConfig(_Section):
    storage_path: str = Field(
        "./runs", description="Parent of the run directory: a local path, or object storage "
        "(s3://bucket/prefix, gs://..., abfs://...) read and written through pyarrow.fs; on a "
        "multi-node cluster a bucket (or a filesystem every node mounts). Default: "
        "$RAYTRAIN_DDP_STORAGE_PATH when set (the cluster files set it), else ./runs.",
    )
    log_every_steps: int = Field(10, ge=1, description="Driver progress and metrics.jsonl interval.")
    checkpoint_every_steps: Union[int, Literal["auto"]] = Field(
        0, description="0: checkpoint only at epoch ends; N: also every N optimizer steps; auto: "
        "Young's interval sqrt(2 x MTBF x save stall) in steps, from the save stall and step time "
        "measured on this run and its observed mean time between interruptions (run.expected_mtbf_s "
        "before there is one), chosen again at every restart and said in one line (docs/usage.md).",
    )
    checkpoint_every_epochs: int = Field(
        1, ge=1, description="N: checkpoint at the end of every Nth epoch (and at the run's last step, and "
        "at an epoch end a preemption signal reached); the cadence in epochs, instead of "
        "checkpoint_every_steps (set one of the two).",
    )
    expected_mtbf_s: float = Field(
        3600.0, gt=0.0, description="checkpoint_every_steps auto: the mean time between interruptions "
        "to plan with until this run has observed one (raytrain-ddp goodput shows the observed one).",
    )
    checkpoint_upload: Literal["async", "sync"] = Field(
        "async", description="async: training goes on while Ray uploads the checkpoint to "
        "storage (the step loop waits only for serialising it, see checkpoint_blocked_s in "
        "metrics.jsonl); sync: each checkpoint waits for its upload. Just-in-time saves before "
        "a preemption are always sync.",
    )
    validation: Literal["inline", "async"] = Field(
        "inline", description="inline: every rank validates at each epoch end, inside the step loop (the loop "
        "waits for the whole pass); async: rank 0 validates the epoch-end checkpoint just saved on a thread of "
        "its own, off the training path, and the val_* line lands at that checkpoint's step; the run's end waits "
        "for it, a resume validates the newest epoch-end checkpoint again. Needs run.checkpoint_every_epochs=1 "
        "(it validates checkpoints). See docs/usage.md#asynchronous-validation.",
    )
    loggers: list[Literal["jsonl", "tensorboard", "mlflow", "wandb"]] = Field(
        ["jsonl"], description="Where the driver writes metrics: jsonl (metrics.jsonl in the run "
        "directory), tensorboard (event files in <run dir>/tensorboard), mlflow (the tracking "
        "server of $MLFLOW_TRACKING_URI; needs the mlflow package), wandb (Weights & Biases, "
        "project named after the run or $WANDB_PROJECT; needs the wandb package). The trackers "
        "get a step's point once a checkpoint covers it, so redone steps count once.",
    )
    # issue #28 seam: "live" (recovery/live.py, recovery/live_driver.py)
    recovery: Literal["replica", "checkpoint", "live"] = Field(
        "replica", description="When a worker dies mid-run: replica (the surviving workers, which "
        "hold identical copies of the model and optimizer, write the last completed step as their "
        "collective fails, and the restarted group resumes from it: at most the step in flight is "
        "redone; strategies naive, bucketed, native), live (the survivors keep their processes and "
        "wait at the step boundary; only the lost worker is replaced, and it receives the state from "
        "a survivor over the network: Ray's replica groups and torchft, needs the torchft package; "
        "naive, bucketed and native, the others fall back to replica) or checkpoint (resume from the newest "
        "durable checkpoint only). See docs/reliability.md.",
    )
    num_to_keep: int = Field(2, ge=1, description="Checkpoints kept on disk.")
    max_failures: int = Field(1, ge=-1, description="Worker-group restarts allowed; -1 is unlimited.")
    max_preemption_failures: int = Field(
        -1, ge=-1, description="Restarts after node preemptions (spot reclaims), counted apart "
        "from run.max_failures; -1 is unlimited.",
    )
    preemption_grace_s: float = Field(
        0.0, ge=0.0,
        description="Seconds the surviving workers may run past a preemption deadline so a "
        "just-in-time checkpoint can finish (also lets Ray's checkpoint report complete "
        "without the preempted workers).",
    )
    resume: Optional[str] = Field(
        None, description="null: continue this run name's latest checkpoint if there is one; "
        "'latest': the same, but an error if there is none; a path: that checkpoint; "
        "'never': start fresh (an existing run directory of that name is an error)."
    )
    address: Optional[str] = Field(
        None, description="Ray cluster to join; default: $RAY_ADDRESS, else an embedded local instance."
    )
    dashboard: bool = Field(
        False, description="Start the embedded local instance's dashboard (bound to 127.0.0.1): the web UI, "
        "`ray list actors` and the state API. Off by default, since the instance serves no jobs and the "
        "start is shorter without it (docs/design.md#the-embedded-instance-starts-lean). A joined "
        "cluster's dashboard is the cluster's.",
    )

    @field_validator("checkpoint_every_steps", mode="before")
    @classmethod
    def _steps_or_auto(cls, value: Any) -> Any:
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError("must be a number of steps >= 0, or auto")
        return value

    @model_validator(mode="after")
    def _one_cadence(self) -> "RunConfig":
        if self.checkpoint_every_epochs > 1 and self.checkpoint_every_steps != 0:
            raise ValueError(f"run.checkpoint_every_epochs={self.checkpoint_every_epochs} and run.checkpoint_every_"
                             f"steps={self.checkpoint_every_steps} are two cadences: set one of the two")
        return self

    @field_validator("loggers")
    @classmethod
    def _loggers_once_each(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"each logger at most once, got {value}")
        return value
    profile: ProfileConfig = Field(default_factory=ProfileConfig)


class Config(_Section):
    """A whole run. Field order is the order `config.yaml` is written in."""

    name: str = Field("run", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$",
                      description="Run name; the run directory is `<run.storage_path>/<name>`.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _cross_field(self) -> "Config":
        checks.cross_field(self)
        return self

    def valid_worker_counts(self) -> list[int]:
        """Worker counts in the configured range that keep the global batch exact."""
        return [
            w for w in range(self.scaling.min_workers, self.scaling.max_workers + 1)
            if self.train.global_batch_size % (w * self.train.micro_batch_size) == 0
        ]

    def accumulation_steps(self, num_workers: int) -> int:
        """Micro-steps per optimizer step for the actual worker count (re-derived on resize)."""
        per_step = num_workers * self.train.micro_batch_size
        if self.train.global_batch_size % per_step:
            raise ConfigError(checks.batch_error(self, num_workers))
        return self.train.global_batch_size // per_step

    def chunk_rows(self) -> int:
        """data.chunk_rows, or its default for the micro batch (sharded sharding)."""
        return self.data.chunk_rows or checks.default_chunk_rows(self.train.micro_batch_size)

    def to_yaml(self) -> str:
        data = self.model_dump(mode="json")
        if isinstance(self.scaling.num_workers, tuple):
            data["scaling"]["num_workers"] = list(self.scaling.num_workers)
        return yaml.safe_dump(data, sort_keys=False)
