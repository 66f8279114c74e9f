"""The small cluster tools: capacity requests (cluster/request_capacity.py) and the smoke job's config checks."""

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load(relative: str):
    spec = importlib.util.spec_from_file_location(Path(relative).stem, REPO / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


request_capacity = load("cluster/request_capacity.py")
smoke_train = load("cluster/smoke_train.py")


def test_capacity_request_asks_one_bundle_per_worker():
    request = request_capacity.CapacityRequest(workers=16, cpus_per_worker=8, gpus_per_worker=1, wait_s=0)
    assert request.bundles() == [{"CPU": 8, "GPU": 1}] * 16
    assert request.totals() == {"CPU": 128, "GPU": 16}
    assert request_capacity.CapacityRequest(workers=2, cpus_per_worker=1, gpus_per_worker=0, wait_s=0).bundles() == [{"CPU": 1}] * 2


def test_release_is_an_empty_request():
    assert request_capacity.CapacityRequest(workers=0, cpus_per_worker=1, gpus_per_worker=0, wait_s=0).bundles() == []


@pytest.mark.parametrize("kwargs, message", [
    (dict(workers=-1, cpus_per_worker=1, gpus_per_worker=0, wait_s=0), "--workers"),
    (dict(workers=2, cpus_per_worker=0, gpus_per_worker=0, wait_s=0), "some CPU or GPU"),
    (dict(workers=2, cpus_per_worker=1, gpus_per_worker=0, wait_s=-5), "--wait"),
])
def test_bad_capacity_requests_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        request_capacity.CapacityRequest(**kwargs)


def test_smoke_job_arguments_are_checked_before_anything_starts():
    cfg = smoke_train.parse_args(["--num-workers", "16", "--gpus-per-worker", "1", "--storage-path", "s3://b/ray"])
    assert (cfg.num_workers, cfg.gpus_per_worker, cfg.storage_path) == (16, 1.0, "s3://b/ray")
    with pytest.raises(ValueError, match="--num-workers"):
        smoke_train.parse_args(["--num-workers", "0"])
    with pytest.raises(ValueError, match="--cpus-per-worker"):
        smoke_train.parse_args(["--cpus-per-worker", "0"])
