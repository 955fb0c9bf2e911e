"""The benchmark suite's pieces that need no Ray, and its JSON's sections with sane values.

The whole run (tests/ray/bench/test_bench_smoke.py, marked `bench_smoke`: it starts Ray) is
`make test-bench`'s, not `make test`'s: `make test` runs each section at toy size instead
(test_bench_sections.py); here are the bench's pieces that need no Ray.

Timings are checked only for being positive and finite (this machine is shared and
noisy); the exact counts (bytes sent / theoretical minimum, calls on non-final
micro-steps) are asserted exactly. The suite runs with the `smoke` preset
(RAYTRAIN_DDP_BENCH_SIZE=smoke): `--quick`'s code paths with fewer repetitions, so the
test fits its budget while other tests load the machine.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _bench import TIMED, VARIANTS, positive as _positive

REPO = Path(__file__).resolve().parents[3]


def _raytrain_ddp() -> list[str]:
    return [sys.executable, "-m", "raytrain_ddp"]


@pytest.mark.timeout(60)
def test_cuda_without_a_gpu_is_a_clear_error(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("RAYTRAIN_DDP_BENCH_CUDA_DRYRUN", None)
    proc = subprocess.run(_raytrain_ddp() + ["bench", "--device", "cuda", "--out", str(tmp_path / "g.json")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2
    assert "no CUDA device is visible" in proc.stderr and "--device cpu" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "g.json").exists()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_gpu_code_paths_dry_run_on_cpu():
    """The CUDA preset's DataParallel row and bf16 GPT section, exercised on gloo/CPU."""
    from benchmarks import gpu, strategies

    sizes = gpu.DRYRUN_SIZES
    section = strategies.run(sizes, device="cpu", world_size=1, models=("mlp",), with_dp=True, log=lambda _: None)
    assert _positive(section["mlp"]["step_ms"]["data_parallel"])
    assert _positive(section["mlp"]["ratios"]["data_parallel_over_native"])
    gpt = gpu.gpt_section(sizes, gpu.DRYRUN_GPT, "cpu", "gloo", log=lambda _: None)
    assert set(gpt["variants"]) == {"bare", "bucketed", "native"}
    for variant in gpt["variants"].values():
        assert _positive(variant["tokens_per_s"]) and math.isnan(variant["mfu"])  # no peak known on CPU
    assert gpt["flops_per_token"] > 6 * 0.4e6
    assert gpu.peak_flops("NVIDIA H200") == pytest.approx(989.4e12)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_transport_table_times_both_transports():
    from benchmarks import transport

    rows = transport.measure(sizes_mib=(0.0625, 1.0), reps=2)
    assert [row["mib"] for row in rows] == [0.0625, 1.0]
    assert all(_positive(row["gloo_ms"]) and _positive(row["shm_ms"]) and _positive(row["shm_over_gloo"])
               for row in rows), rows


@pytest.mark.timeout(60)
def test_gpu_sh_without_a_gpu_stops_clearly_and_installs_nothing(tmp_path):
    """benchmarks/gpu.sh from a clone on a host without a GPU: no torch install, exit 2."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env["PATH"] = f"{tmp_path}:{env.get('PATH', '')}"  # no nvidia-smi here, whatever the host has
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu.sh")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2, proc.stderr
    assert "installing" not in proc.stdout and "no usable CUDA torch" in proc.stderr


def test_suite_without_ray_records_the_ray_sections_and_goes_on(monkeypatch):
    import sys

    from benchmarks import suite

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    results: dict = {}
    suite._with_ray(results, ("ingest",), lambda: 0.0, lambda _: pytest.fail("ran without Ray"))
    assert results["ingest"]["error"].startswith("Ray unavailable: ModuleNotFoundError")


# The bench's own helpers (moved here from tests/parallel and tests/unit: only this tier imports
# benchmarks/, tests/local/unit/test_layering.py checks it).


def test_the_bench_models_buckets_are_cut_as_torch_ddp_cuts_them():
    """The bench models: torch DDP's buckets after its rebuild (`_get_ddp_logging_data()`'s
    rebuilt_bucket_sizes with default options), byte for byte."""
    from benchmarks.strategies import build_model
    from raytrain_ddp.parallel.bucketed import assign_buckets

    for name, torch_sizes in (("mlp", [1049600, 8396800]), ("gpt", [1187840, 694272])):
        params = list(reversed(list(build_model(name).parameters())))
        buckets = assign_buckets(params, cap_bytes=25 * 2**20)
        assert [sum(params[i].numel() * 4 for i in b) for b in buckets] == torch_sizes, name


def test_paired_ratio_compares_within_rounds_and_ignores_a_disturbed_round():
    """The bench's #19 verdict: per-round medians, then the median over rounds."""
    from benchmarks.strategies import paired_ratio

    # round 2 ran under load: both variants slower, a's ratio within every round stays 0.9
    a = [9.0, 9.0, 9.5, 18.0, 18.0, 19.0, 9.0, 9.0, 9.0]
    b = [10.0, 10.0, 10.5, 20.0, 20.0, 21.0, 10.0, 10.0, 10.0]
    assert paired_ratio(a, b, 3) == pytest.approx(0.9)
    assert paired_ratio(a + [1e6], b + [1.0], 3) == pytest.approx(0.9)  # a partial round is left out
    assert paired_ratio(a, [10.0, 10.0, 10.0] * 2 + [100.0] * 3, 3) == pytest.approx(0.9)  # one bad round
    assert math.isnan(paired_ratio([1.0], [1.0], 3))


def test_launch_interval_is_a_t_interval_of_the_log_ratios():
    from benchmarks.strategies import launch_interval

    mean, low, high = launch_interval([1.02, 1.02, 1.02])
    assert mean == pytest.approx(1.02) and low == pytest.approx(1.02) and high == pytest.approx(1.02)
    mean, low, high = launch_interval([0.98, 1.03, 1.01, 1.04])
    assert mean == pytest.approx((0.98 * 1.03 * 1.01 * 1.04) ** 0.25)
    assert low < 1.0 < high and low * high == pytest.approx(mean * mean)  # symmetric in logs
    wide = launch_interval([0.98, 1.03])  # two launches: the t quantile is 12.7
    assert wide[1] < low and wide[2] > high
    one = launch_interval([1.05])
    assert one[0] == pytest.approx(1.05) and math.isnan(one[1]) and math.isnan(one[2])
    ratio = 3.6607714669911773  # exp(log(r)) is 3.660771466991177: one launch's ratio is returned as it is
    assert launch_interval([ratio])[0] == ratio


def test_outputs_never_land_in_the_current_directory_by_surprise():
    import time

    from benchmarks.suite import default_out

    # bench results are published where the docs cite them, named by preset and date
    assert default_out("quick") == Path(f"benchmarks/results/quick-{time.strftime('%Y-%m-%d', time.gmtime())}.json")
    outputs = ["data/digits.parquet"]
    if not (REPO / ".git").exists():  # a copy without history: the rules must still be there
        assert "/data/" in (REPO / ".gitignore").read_text().split()
        return
    ignored = subprocess.run(["git", "check-ignore", *outputs], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert ignored.stdout.split() == outputs, ignored.stderr
