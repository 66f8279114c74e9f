"""A run's storage on an object store, over the S3 protocol. A moto server on loopback stands in for the bucket, and
everything that writes to train.storage_path talks to it as to AWS: pyarrow's S3 filesystem (the shared compile
cache, the run-id file), Ray Train's checkpoints and their download on resume. The endpoint comes from
AWS_ENDPOINT_URL, the AWS SDK's own variable, as a user's S3-compatible store (MinIO, Ceph, R2) would: the project
has no setting of its own for it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ports import free_ports
from test_job_pretrain import env_without_ray_address, job_overrides
from test_train_support import REPO

pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("ray")]  # one Ray cluster at a time (pyproject.toml)

BUCKET = "runs"


@pytest.fixture(scope="module")
def s3():
    """(the environment that points a process's AWS clients at the stand-in, a pyarrow filesystem on it) with the
    bucket made."""
    import pyarrow.fs as pafs
    from moto.server import ThreadedMotoServer

    port, = free_ports(1)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_DEFAULT_REGION": "us-east-1"}
    fs = pafs.S3FileSystem(endpoint_override=endpoint, access_key="test", secret_key="test", region="us-east-1",
                           allow_bucket_creation=True)
    fs.create_dir(BUCKET)
    try:
        yield env, fs
    finally:
        server.stop()


def objects(fs, prefix: str) -> list[str]:
    import pyarrow.fs as pafs

    infos = fs.get_file_info(pafs.FileSelector(prefix, recursive=True, allow_not_found=True))
    return sorted(i.path[len(prefix) + 1:] for i in infos if i.type == pafs.FileType.File)


def test_the_shared_compile_cache_goes_to_the_bucket_and_comes_back(s3, monkeypatch):
    """The s3:// branch: the save puts the artifacts and the json beside them as objects; a second cache of the
    same key (another node) reads the same bytes back. Only torch.compile's side is stood in for: what it saves and what it loads."""
    from pipeline.train.compile_cache import SharedCompileCache

    env, fs = s3
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    class Info:
        artifacts = {"inductor": ["graph"]}

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts", Info()))
    given = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda blob: given.append(blob) or Info())
    folder = f"s3://{BUCKET}/compile_cache"
    writer = SharedCompileCache(folder, {"test": "s3"})
    writer.save()
    assert writer.saved == 1 and writer.problems == []
    assert objects(fs, f"{BUCKET}/compile_cache") == [f"{writer.key}.bin", f"{writer.key}.json"]
    reader = SharedCompileCache(folder, {"test": "s3"})
    reader.load()
    assert given == [b"artifacts"] and reader.loaded == {("inductor", "graph")} and reader.problems == []
    assert reader.file == f"{folder}/{reader.key}.bin"


def test_a_run_checkpoints_to_the_bucket_and_a_rerun_resumes_from_it(s3, tmp_path):
    """jobs/pretrain.py with train.storage_path on the bucket: 4 steps with a checkpoint every 2 land as objects,
    and the same command with max_steps 6 finds the step-4 checkpoint there, resumes from it and adds step 6's."""
    env, fs = s3
    run_env = {**env_without_ray_address(), **env}
    storage = f"s3://{BUCKET}/ray_results"

    def pretrain(max_steps: int) -> str:
        args = [*job_overrides(tmp_path, "s3-run"), "--set", f"train.storage_path={storage}",
                "--set", f"train.max_steps={max_steps}"]
        proc = subprocess.run([sys.executable, "jobs/pretrain.py", *args], cwd=REPO, env=run_env,
                              capture_output=True, text=True, timeout=600)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-4000:]
        return out

    first = pretrain(4)
    assert "resumed from checkpoint" not in first
    stored = objects(fs, f"{BUCKET}/ray_results/s3-run")
    checkpoints = sorted({p.split("/")[0] for p in stored if p.startswith("checkpoint_step_")})
    assert checkpoints == ["checkpoint_step_00000002", "checkpoint_step_00000004"], stored
    assert any(p.startswith("checkpoint_step_00000004/") and p.endswith(".pt") for p in stored), stored

    second = pretrain(6)
    assert "resumed from checkpoint at step 4" in second, second[-4000:]
    stored = objects(fs, f"{BUCKET}/ray_results/s3-run")
    assert any(p.startswith("checkpoint_step_00000006/") for p in stored), stored
