"""The profiler summary on a CUDA trace counts the NCCL kernels' GPU time, not the CPU's
enqueue spans (docs/parallel.md, audit item 7). Synthetic Chrome traces, microseconds."""

from __future__ import annotations

import json

import pytest

from raytrain_ddp.worker.profiler import summarize_trace, summary_markdown


def _span(name, ts, dur, cat="cpu_op", tid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "pid": 1, "tid": tid}


def _write(tmp_path, events):
    path = tmp_path / "t.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_cuda_trace_counts_nccl_kernels_not_cpu_enqueue(tmp_path):
    events = [
        _span("ProfilerStep#1", 0, 10_000),
        _span("forward", 0, 2_000),
        _span("nccl:all_reduce", 5_000, 20),  # the CPU only enqueues: 0.02 ms
        _span("nccl:all_reduce", 6_000, 20),
        _span("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
              5_100, 1_500, cat="kernel", tid=20),
        _span("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
              6_600, 1_000, cat="kernel", tid=20),
        _span("void at::native::vectorized_elementwise_kernel<...>", 6_000, 2_000, cat="kernel", tid=7),
    ]
    summary = summarize_trace(_write(tmp_path, events))
    assert summary["all-reduce_source"] == "NCCL kernels on the GPU"
    assert summary["all-reduce"] == pytest.approx(2.5)  # 1.5 + 1.0 ms of kernels, not 0.04 ms of enqueue
    assert summary["gpu_busy"] == pytest.approx(2.9)  # 5.1-6.6, 6.6-7.6 and 6.0-8.0 ms: 5.1 to 8.0, once
    assert all(not name.startswith("ncclDevKernel") for name, _ in summary["top"])  # host self time only
    assert "NCCL kernels on the GPU" in summary_markdown(summary) and "GPU busy" in summary_markdown(summary)


def test_cpu_trace_is_read_as_before(tmp_path):
    events = [_span("ProfilerStep#1", 0, 10_000), _span("gloo:all_reduce", 1_000, 3_000, tid=2)]
    summary = summarize_trace(_write(tmp_path, events))
    assert summary["all-reduce"] == pytest.approx(3.0) and summary["all-reduce_source"] == "host spans"
    assert "gpu_busy" not in summary


def test_gpu_side_copies_of_our_labels_are_not_counted_twice(tmp_path):
    """Issue #41 item 5: a real Kineto trace repeats ProfilerStep#, data and forward as
    `gpu_user_annotation` spans on the GPU's timeline; only the CPU-side ones count."""
    cpu = [_span("ProfilerStep#1", 0, 10_000, cat="user_annotation"), _span("data", 0, 1_000, cat="user_annotation"),
           _span("forward", 1_000, 3_000, cat="user_annotation"),
           _span("ProfilerStep#2", 10_000, 10_000, cat="user_annotation"),
           _span("data", 10_000, 1_000, cat="user_annotation"), _span("forward", 11_000, 3_000, cat="user_annotation")]
    gpu = [_span(e["name"], e["ts"] + 500, e["dur"] * 2, cat="gpu_user_annotation", tid=7) for e in cpu]
    kernels = [_span("void gemm_kernel<...>", 1_500, 2_000, cat="kernel", tid=7)]
    summary = summarize_trace(_write(tmp_path, cpu + gpu + kernels))
    assert summary["steps"] == 2
    assert summary["step"] == pytest.approx(10.0) and summary["data"] == pytest.approx(1.0)
    assert summary["forward"] == pytest.approx(3.0)
    assert summary["gpu_busy"] == pytest.approx(1.0)  # 2 ms of kernels over 2 steps
    assert all(name not in ("data", "forward") or ms == pytest.approx(2.0 if name == "data" else 6.0)
               for name, ms in summary["top"])  # self time: host spans only
