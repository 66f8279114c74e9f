"""Ask the Ray autoscaler for capacity ahead of a job, wait until it has joined, or give it back.

    python cluster/request_capacity.py --workers 16 --gpus-per-worker 1 --cpus-per-worker 8 --wait 1800
    python cluster/request_capacity.py --release

Why: an autoscaling cluster starts with its head only. Anything that sizes itself from what the cluster
has *now* (Tune's concurrency from ray.cluster_resources() where the autoscaler reports no maximum) sees
no GPUs until nodes are up. Requesting the capacity first makes the nodes come up; the job then finds
them. (A training job needs no such step: on a joined cluster its preflight does not count GPUs, and Ray
Train's worker group waits for the nodes the autoscaler adds.) The request stays in force (the nodes are kept) until --release,
after which idle nodes go away after the cluster's idle timeout.

Joins the cluster named by RAY_ADDRESS (or the submitted job's); never starts one.
"""

import argparse
import sys
import time
from dataclasses import dataclass

import ray
from ray.autoscaler.sdk import request_resources


@dataclass(frozen=True)
class CapacityRequest:
    workers: int
    cpus_per_worker: float
    gpus_per_worker: float
    wait_s: float

    def __post_init__(self):
        if self.workers < 0:
            raise ValueError(f"--workers must be >= 0, got {self.workers}")
        if self.cpus_per_worker < 0 or self.gpus_per_worker < 0:
            raise ValueError("--cpus-per-worker and --gpus-per-worker must be >= 0")
        if self.workers and self.cpus_per_worker == 0 and self.gpus_per_worker == 0:
            raise ValueError("a worker must ask for some CPU or GPU")
        if self.wait_s < 0:
            raise ValueError(f"--wait must be >= 0 seconds, got {self.wait_s}")

    def bundles(self) -> list[dict[str, float]]:
        bundle = {k: v for k, v in (("CPU", self.cpus_per_worker), ("GPU", self.gpus_per_worker)) if v > 0}
        return [dict(bundle) for _ in range(self.workers)]

    def totals(self) -> dict[str, float]:
        return {"CPU": self.workers * self.cpus_per_worker, "GPU": self.workers * self.gpus_per_worker}


def has_capacity(totals: dict[str, float]) -> bool:
    present = ray.cluster_resources()
    return all(present.get(name, 0.0) >= amount for name, amount in totals.items() if amount > 0)


def wait_for_capacity(request: CapacityRequest, poll_s: float = 5.0) -> bool:
    deadline = time.monotonic() + request.wait_s
    while not has_capacity(request.totals()):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--cpus-per-worker", type=float, default=1.0)
    parser.add_argument("--gpus-per-worker", type=float, default=0.0)
    parser.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the capacity to join (0: do not wait)")
    parser.add_argument("--release", action="store_true", help="withdraw any earlier request")
    args = parser.parse_args(argv)
    try:
        request = CapacityRequest(0 if args.release else args.workers, args.cpus_per_worker, args.gpus_per_worker, args.wait)
    except ValueError as error:
        sys.exit(f"request_capacity.py: {error}")
    if not args.release and request.workers == 0:
        sys.exit("request_capacity.py: give --workers N, or --release")

    ray.init(address="auto")  # only ever an existing cluster
    # One standing request replaces any earlier one; an empty request withdraws it.
    request_resources(bundles=request.bundles())
    if args.release:
        print("request_capacity.py: request withdrawn; idle nodes leave after the idle timeout", flush=True)
        return
    print(f"request_capacity.py: asked for {request.workers} x {request.bundles()[0]}", flush=True)
    if request.wait_s and not wait_for_capacity(request):
        sys.exit(f"request_capacity.py: the cluster has {ray.cluster_resources()} after {request.wait_s:.0f}s, "
                 f"short of {request.totals()} (quota? capacity in the zone? see monitor.log on the head)")
    print(f"request_capacity.py: cluster resources now {ray.cluster_resources()}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
