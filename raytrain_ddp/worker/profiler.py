"""`run.profile`: a torch.profiler trace of a few optimizer steps on rank 0, and where their time went.

Owns: when profiling starts and stops (its cadence: `run.profile.start_step` and
`run.profile.steps`, counted in the run's optimizer steps, with one warm-up step before),
the labels it adds while it records (`data`: fetching a step's window of micro-batches;
`forward`: the model's forward, through module hooks that exist only while recording),
and the files under `<run dir>/profile/`:

    rank0_steps<a>-<b>.pt.trace.json   the Chrome/Kineto trace: open it in Perfetto
                                       (ui.perfetto.dev), chrome://tracing, or TensorBoard's
                                       profiler plugin (point --logdir at profile/)
    summary.md                         `summarize_trace`'s table (time per step in data,
                                       forward, backward, all-reduce, optimizer) and torch's
                                       own operator table

Must not touch: training (it only observes), other ranks (every rank runs the same step,
so rank 0's trace stands for all), the driver.

Why the loop wraps its window iterator (`profiler.steps(...)`) instead of calling the
profiler after each step: one line in the loop, and the profiler sees both ends of a
step — the fetch of its window (data) and the return for the next one (step done).
A run resumed past `start_step` records nothing (those steps are done); a run that ends
inside the window writes what it recorded.

How the trace reaches the run directory: written locally, then copied with
`pyarrow.fs` (the same filesystems as the run directory: local, NFS or object storage).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from raytrain_ddp.job import Job
from raytrain_ddp.worker.context import Rank

if TYPE_CHECKING:
    from raytrain_ddp.worker.state import TrainState

PROFILE_DIR = "profile"
SUMMARY_FILE = "summary.md"
BACKWARD_PREFIX = "autograd::engine::evaluate_function:"
OPTIMIZER_PREFIXES = ("Optimizer.step#", "Optimizer.zero_grad#")
ALLREDUCE_NAMES = ("gloo:all_reduce", "nccl:all_reduce", "shm:all_reduce")  # shm: parallel/shm.py's SPAN
# On CUDA the CPU's `nccl:*` spans only enqueue the collective (microseconds); the time it
# takes is the NCCL kernels' on the GPU (ncclDevKernel_AllReduce_..., ncclKernel_... by version).
NCCL_KERNEL_PREFIX = "nccl"
GPU_KERNEL_CATEGORIES = ("kernel",)
# Kineto repeats each CPU-side label (ProfilerStep#, data, forward) on the GPU's timeline as a
# `gpu_user_annotation` span (the kernels it launched): counting those would double the steps and
# mix GPU time into the host's parts, so the step parts read CPU-side spans only (issue #41 item 5).
GPU_ANNOTATION_CATEGORY = "gpu_user_annotation"


class StepProfiler:
    """Records steps [start_step, start_step + steps) on rank 0; a no-op everywhere else."""

    def __init__(self, job: Job, rank: Rank, state: "TrainState", total_steps: int) -> None:
        spec = job.cfg.run.profile
        self.job, self.rank, self.state, self.total_steps = job, rank, state, total_steps
        self.first, self.last = spec.start_step, spec.start_step + spec.steps - 1
        self.warmup = 1 if spec.start_step > 1 else 0
        self.enabled = rank.is_main and spec.steps > 0
        self._prof: Any = None
        self._hooks: list[Any] = []
        self._open: list[Any] = []
        if self.enabled and state.progress.step >= self.first - self.warmup:
            rank.say(f"run.profile: steps {self.first}-{self.last} are done already (resumed at step "
                     f"{state.progress.step}); no trace this time")
            self.enabled = False
        self._maybe_start()

    # -- the loop's view -----------------------------------------------------------

    def steps(self, windows: Iterable[Any]) -> Iterator[Any]:
        """Yield the loop's windows; each return for the next one closes a step."""
        if not self.enabled:
            yield from windows
            return
        inner, end = iter(windows), object()
        try:
            while True:
                with self._label("data"):
                    window = next(inner, end)
                if window is end:
                    return
                yield window
                self._step_done()
        finally:
            if self._prof is not None and self.state.progress.step >= self.total_steps:
                self._finish()  # the run ended inside the window: keep what was recorded

    # -- cadence ---------------------------------------------------------------------

    def _maybe_start(self) -> None:
        if not self.enabled or self._prof is not None:
            return
        if self.state.progress.step != self.first - self.warmup - 1:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof = profile(activities=activities, record_shapes=self.job.cfg.run.profile.record_shapes,
                             schedule=schedule(wait=0, warmup=self.warmup, active=self.last - self.first + 1,
                                               repeat=1),
                             on_trace_ready=self._save)
        self._prof.start()
        self._hook_forward()

    def _step_done(self) -> None:
        step = self.state.progress.step
        if self._prof is not None:
            self._prof.step()
            if step >= self.last:
                self._finish()
        else:
            self._maybe_start()

    def _finish(self) -> None:
        prof, self._prof = self._prof, None
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if prof is not None:
            prof.stop()  # calls on_trace_ready if the active window was cut short
            self.enabled = False

    # -- labels ----------------------------------------------------------------------

    def _label(self, name: str) -> Any:
        from torch.profiler import record_function

        return record_function(name)

    def _hook_forward(self) -> None:
        """Label the model's forward (the loss and the wrapper's bookkeeping stay outside)."""
        module = self.state.module

        def enter(*_: Any) -> None:
            label = self._label("forward")
            label.__enter__()
            self._open.append(label)

        def leave(*_: Any) -> None:
            if self._open:
                self._open.pop().__exit__(None, None, None)

        self._hooks = [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]

    # -- output ----------------------------------------------------------------------

    def _save(self, prof: Any) -> None:
        last = min(self.last, self.state.progress.step)
        with tempfile.TemporaryDirectory(prefix="raytrain_ddp_profile_") as tmp:
            trace = Path(tmp) / f"rank0_steps{self.first}-{last}.pt.trace.json"
            prof.export_chrome_trace(str(trace))
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
            (Path(tmp) / SUMMARY_FILE).write_text(
                f"# Profile of steps {self.first}-{last} (rank 0 of {self.rank.world_size})\n\n"
                f"{summary_markdown(summarize_trace(trace))}\n\n## torch's operator table\n\n```\n{table}\n```\n")
            dest = _copy_to_run_dir(tmp, self.job)
        self.rank.say(f"run.profile: trace of steps {self.first}-{last} in {dest}")


def _copy_to_run_dir(local_dir: str, job: Job) -> str:
    import pyarrow.fs as pafs

    storage = job.cfg.run.storage_path
    if "://" in storage and not storage.startswith("file://"):
        fs, base = pafs.FileSystem.from_uri(storage)  # query parameters (endpoint) configure fs
        dest = f"{base.rstrip('/')}/{job.cfg.name}/{PROFILE_DIR}"
        shown = f"{storage.split('?', 1)[0].rstrip('/')}/{job.cfg.name}/{PROFILE_DIR}"
    else:
        fs, dest = pafs.LocalFileSystem(), os.path.join(str(job.run_dir), PROFILE_DIR)
        os.makedirs(dest, exist_ok=True)
        shown = dest
    pafs.copy_files(local_dir, dest, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
    return shown


# ------------------------------------------------------------------ reading a trace back


def summarize_trace(path: os.PathLike | str) -> dict[str, Any]:
    """Milliseconds per profiled step in each part of a step, read from a Chrome trace.

    `step` is the wall time of a `ProfilerStep#`; `data`, `forward` are our labels;
    `backward` sums the autograd engine's node evaluations; `optimizer` torch's
    `Optimizer.step#` / `zero_grad#` labels; `all-reduce` the collectives' own spans on
    the communication thread (they overlap backward: bucketed and native DDP launch them
    while backward runs) -- on a CUDA trace instead the NCCL kernels' time on the GPU
    (the CPU's `nccl:*` spans are only the enqueue), with `gpu_busy` beside it;
    `all-reduce_source` says which, and bucketed's shared-memory copies and sums (`shm:all_reduce`,
    on the training thread, the copy inside backward); `other` is the step minus data, forward, backward and
    optimizer (loss, clipping, the finiteness vote, scheduling, waiting for the last
    bucket when it is not inside backward). Also `top`: the 10 names with the most
    self time (their own, without the spans nested in them: torch's "Self CPU"), as
    (name, ms over all recorded steps).
    """
    events = [e for e in json.loads(Path(path).read_text()).get("traceEvents", [])
              if e.get("ph") == "X" and "dur" in e and e.get("cat") != GPU_ANNOTATION_CATEGORY]
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    n = max(1, len(steps))

    def total(match: Any) -> float:
        return sum(float(e["dur"]) for e in events if match(str(e.get("name", "")))) / 1000.0 / n

    kernels = [e for e in events if e.get("cat") in GPU_KERNEL_CATEGORIES]
    nccl = [e for e in kernels if str(e.get("name", "")).lower().startswith(NCCL_KERNEL_PREFIX)]
    host = [e for e in events if e.get("cat") not in GPU_KERNEL_CATEGORIES]
    out = {
        "steps": len(steps),
        "step": total(lambda s: s.startswith("ProfilerStep#")),
        "data": total(lambda s: s == "data"),
        "forward": total(lambda s: s == "forward"),
        "backward": total(lambda s: s.startswith(BACKWARD_PREFIX)),
        "all-reduce": total(lambda s: s in ALLREDUCE_NAMES),
        "optimizer": total(lambda s: s.startswith(OPTIMIZER_PREFIXES)),
        "all-reduce_source": "host spans",
    }
    if kernels:  # a CUDA trace: communication is what the NCCL kernels took on the GPU
        out["all-reduce"] = _union_ms(nccl) / n
        out["all-reduce_source"] = "NCCL kernels on the GPU"
        out["gpu_busy"] = _union_ms(kernels) / n  # any kernel running: the GPU's share of the step
        events = host  # self time below: the host's spans only (kernels overlap them)
    out["other"] = max(0.0, out["step"] - out["data"] - out["forward"] - out["backward"] - out["optimizer"])
    out["top"] = _top_by_self_time(events)[:10]
    return out


def _union_ms(spans: list[dict[str, Any]]) -> float:
    """Milliseconds covered by at least one span (overlapping kernels on several streams count once)."""
    covered, end = 0.0, float("-inf")
    for e in sorted(spans, key=lambda e: float(e["ts"])):
        start, stop = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if stop > end:
            covered += stop - max(start, end)
            end = stop
    return covered / 1000.0


def _top_by_self_time(events: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """Per name, the time its spans spent outside their nested spans (thread by thread)."""
    by_thread: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for e in events:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    own: dict[str, float] = {}
    for spans in by_thread.values():
        spans.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack: list[list[Any]] = []  # [end, name, self time so far]
        for e in spans:
            start, dur = float(e["ts"]), float(e["dur"])
            while stack and stack[-1][0] <= start:
                _, name, mine = stack.pop()
                own[name] = own.get(name, 0.0) + mine
            if stack:
                stack[-1][2] -= dur  # a child's time is not its parent's own
            stack.append([start + dur, str(e.get("name", "")), dur])
        for _, name, mine in stack:
            own[name] = own.get(name, 0.0) + mine
    skip = ("ProfilerStep#", "PyTorch Profiler")  # the step and whole-trace spans
    return sorted(((n, max(0.0, t) / 1000.0) for n, t in own.items() if not n.startswith(skip)),
                  key=lambda kv: kv[1], reverse=True)


def summary_markdown(summary: dict[str, Any]) -> str:
    step = max(summary["step"], 1e-9)
    rows = ["| part of a step | ms per step | share of the step |", "| --- | ---: | ---: |"]
    gpu = summary.get("all-reduce_source") == "NCCL kernels on the GPU"
    for key in ("data", "forward", "backward", "all-reduce", "optimizer", "other"):
        note = {"all-reduce": (" (NCCL kernels on the GPU, overlapping backward's kernels)" if gpu else
                               " (communication thread, overlaps backward; through shared memory: "
                               "the copies and sums, on the training thread)"),
                "other": " (loss, clipping, votes across ranks, Python between ops, waits)"}.get(key, "")
        rows.append(f"| {key}{note} | {summary[key]:.2f} | {100 * summary[key] / step:.0f}% |")
    if "gpu_busy" in summary:
        rows.append(f"| GPU busy (any kernel) | {summary['gpu_busy']:.2f} | {100 * summary['gpu_busy'] / step:.0f}% |")
    rows.append(f"| **step (wall)** | **{summary['step']:.2f}** | {summary['steps']} steps recorded |")
    return "\n".join(rows)
