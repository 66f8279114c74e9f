"""A run's storage on an object store, over Google Cloud Storage's JSON API. gcp-storage-emulator on loopback stands
in for the bucket, and everything that writes to train.storage_path talks to it as to GCS: pyarrow's GCS
filesystem (the shared compile cache, the run-id file), Ray Train's checkpoints and their download on resume. The
paths stay plain gs://<bucket>/... : the endpoint comes from CLOUD_STORAGE_EMULATOR_ENDPOINT, the variable of the
GCS client inside pyarrow (google-cloud-cpp), as a user's GCS-compatible endpoint would; the project has no
setting of its own for it. The credentials are Application Default Credentials as a user's would be:
GOOGLE_APPLICATION_CREDENTIALS names a service-account key, here one made for the test with a fresh RSA key, which
google-cloud-cpp turns into a self-signed JWT without asking a token server (the emulator does not check it).
The key's token server and GCE_METADATA_ROOT point at a closed loopback port, so a token exchange or a lookup that
fell through to the metadata server would fail here at once instead of leaving the machine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ports import free_ports
from test_job_pretrain import env_without_ray_address, job_overrides
from test_storage_s3 import objects
from test_train_support import REPO

pytest.importorskip("gcp_storage_emulator", reason="gcp-storage-emulator (the dev extra) is not installed")

pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("ray")]  # one Ray cluster at a time (pyproject.toml)

BUCKET = "runs"


def service_account_key(path, token_uri: str) -> None:
    """A service-account key file as the GCP console gives one, for an account that does not exist."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    path.write_text(json.dumps({
        "type": "service_account", "project_id": "test", "private_key_id": "test", "private_key": pem,
        "client_email": "test@test.iam.gserviceaccount.com", "client_id": "1",
        "token_uri": token_uri}))


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """(the environment that points a process's GCS clients at the stand-in, a pyarrow filesystem on it) with the
    bucket made. The filesystem the tests look through is given the endpoint itself, not the environment."""
    import pyarrow.fs as pafs
    from gcp_storage_emulator.server import create_server

    port, closed = free_ports(2)
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server.start()
    key = tmp_path_factory.mktemp("gcs") / "service_account.json"
    service_account_key(key, f"http://127.0.0.1:{closed}/token")
    env = {"CLOUD_STORAGE_EMULATOR_ENDPOINT": f"http://127.0.0.1:{port}", "GOOGLE_APPLICATION_CREDENTIALS": str(key),
           "GOOGLE_CLOUD_PROJECT": "test", "GCE_METADATA_ROOT": f"127.0.0.1:{closed}"}
    fs = pafs.GcsFileSystem(anonymous=True, scheme="http", endpoint_override=f"127.0.0.1:{port}")
    try:
        yield env, fs
    finally:
        server.stop()


def test_the_shared_compile_cache_goes_to_the_bucket_and_comes_back(gcs, monkeypatch):
    """The gs:// branch: the save puts the artifacts and the json beside them as objects; a second cache of the
    same key (another node) reads the same bytes back. Only torch.compile's side is stood in for: what it saves and
    what it loads."""
    from pipeline.train.compile_cache import SharedCompileCache

    env, fs = gcs
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    class Info:
        artifacts = {"inductor": ["graph"]}

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts", Info()))
    given = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda blob: given.append(blob) or Info())
    folder = f"gs://{BUCKET}/compile_cache"
    writer = SharedCompileCache(folder, {"test": "gcs"})
    writer.save()
    assert writer.saved == 1 and writer.problems == []
    assert objects(fs, f"{BUCKET}/compile_cache") == [f"{writer.key}.bin", f"{writer.key}.json"]
    reader = SharedCompileCache(folder, {"test": "gcs"})
    reader.load()
    assert given == [b"artifacts"] and reader.loaded == {("inductor", "graph")} and reader.problems == []
    assert reader.file == f"{folder}/{reader.key}.bin"


def test_a_run_checkpoints_to_the_bucket_and_a_rerun_resumes_from_it(gcs, tmp_path):
    """jobs/pretrain.py with train.storage_path on the bucket: 4 steps with a checkpoint every 2 land as objects,
    and the same command with max_steps 6 finds the step-4 checkpoint there, resumes from it and adds step 6's."""
    env, fs = gcs
    run_env = {**env_without_ray_address(), **env}
    storage = f"gs://{BUCKET}/ray_results"

    def pretrain(max_steps: int) -> str:
        args = [*job_overrides(tmp_path, "gs-run"), "--set", f"train.storage_path={storage}",
                "--set", f"train.max_steps={max_steps}"]
        proc = subprocess.run([sys.executable, "jobs/pretrain.py", *args], cwd=REPO, env=run_env,
                              capture_output=True, text=True, timeout=600)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-4000:]
        return out

    first = pretrain(4)
    assert "resumed from checkpoint" not in first
    stored = objects(fs, f"{BUCKET}/ray_results/gs-run")
    checkpoints = sorted({p.split("/")[0] for p in stored if p.startswith("checkpoint_step_")})
    assert checkpoints == ["checkpoint_step_00000002", "checkpoint_step_00000004"], stored
    assert any(p.startswith("checkpoint_step_00000004/") and p.endswith(".pt") for p in stored), stored

    second = pretrain(6)
    assert "resumed from checkpoint at step 4" in second, second[-4000:]
    stored = objects(fs, f"{BUCKET}/ray_results/gs-run")
    assert any(p.startswith("checkpoint_step_00000006/") for p in stored), stored
