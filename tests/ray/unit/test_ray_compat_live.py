"""ray_compat's functions checked against a live Ray instance (the session's `ray_cluster`);
the pins that need no instance are tests/local/unit/test_ray_compat.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from _compat import ray_gone as _gone
import ray


from raytrain_ddp import ray_compat

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(ray_compat.__file__).resolve().parent


@pytest.mark.timeout(180)  # the session's Ray start included
def test_refresh_autoscaling_coordinator_on_a_live_one(ray_cluster):
    """The branch this Ray takes (recompute on 2.60, `_tick` on 2.59) runs on a real coordinator."""
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    get_or_create_autoscaling_coordinator()
    assert ray_compat.refresh_autoscaling_coordinator("raytrain-ddp:test", timeout_s=30.0), \
        _gone("refresh_autoscaling_coordinator", "a working refresh of the live coordinator")


@pytest.mark.timeout(180)  # the session's Ray start included
def test_cancel_autoscaling_request(ray_cluster):
    """A request left by a dead fit is gone from the live coordinator once cancelled."""
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    coordinator = get_or_create_autoscaling_coordinator()
    handle = ray.get_actor(*ray_compat.COORDINATOR)
    ray.get(handle.request_resources.remote(requester_id="train-dead", resources=[{"CPU": 1}], expire_after_s=180))
    requests = lambda: ray.get(handle.__ray_call__.remote(lambda actor: sorted(actor._ongoing_reqs)))  # noqa: E731
    assert "train-dead" in requests(), _gone("cancel_autoscaling_request", "_AutoscalingCoordinatorActor._ongoing_reqs")
    assert ray_compat.cancel_autoscaling_request("train-dead", timeout_s=30.0)
    assert "train-dead" not in requests(), _gone("cancel_autoscaling_request", "cancel_request(requester_id)")
    assert coordinator is not None


def test_local_instance_kwargs_start_workers_at_our_niceness(ray_cluster):
    """The session's instance is started with `local_instance_kwargs` (tests/conftest.py), as an
    embedded run's is: an actor with a runtime environment (Ray Train's workers have one) and a
    task both run at this process's niceness, not Ray's default 15."""
    import os

    @ray.remote(num_cpus=0, runtime_env={"env_vars": {"RAYTRAIN_DDP_NICENESS_PROBE": "1"}})
    class Probe:
        def niceness(self) -> int:
            return os.nice(0)

    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    probe = Probe.remote()
    try:
        seen = ray.get([probe.niceness.remote(), niceness.remote()], timeout=120)
    finally:
        ray.kill(probe)
    assert seen == [os.nice(0)] * 2, _gone("local_instance_kwargs", f"_system_config {ray_compat.WORKER_NICENESS_CONFIG!r}")


def test_placement_group_job(ray_cluster):
    """The id layout `placement_group_job` reads, and the sweep's end that relies on it: a group
    of this job still held is removed and counted; so is nothing of another job."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from raytrain_ddp.sweep.run import placement_groups_left

    assert ray.PlacementGroupID.size() == 14 + ray.JobID.size(), _gone("placement_group_job", "PlacementGroupID layout")
    job = ray.get_runtime_context().get_job_id()
    group = placement_group([{"CPU": 0.01}])
    try:
        ray.get(group.ready(), timeout=30)
        assert ray_compat.placement_group_job(group.id.hex()) == job, _gone("placement_group_job", "JobID suffix")
        assert ray_compat.placement_group_job("ab" * 14 + "07000000") == "07000000"
        left, removed = placement_groups_left(timeout_s=0.5)
        assert (left, removed) == ([], 1)
        assert ray.util.placement_group_table(group)["state"] == "REMOVED"
    finally:
        if ray.util.placement_group_table(group)["state"] != "REMOVED":
            remove_placement_group(group)
