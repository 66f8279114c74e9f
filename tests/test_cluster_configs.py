"""The cluster configs: Ray's own validation of the autoscaler YAMLs, and what the KubeRay manifests must hold."""

import copy
import re
from pathlib import Path

import pytest
import ray
import yaml
from ray.autoscaler._private import providers
from ray.autoscaler._private.util import prepare_config, validate_config

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "cluster"
RAY_VERSION = "2.60.0"
GPU_IMAGE = f"rayproject/ray:{RAY_VERSION}-py311-gpu"
CLOUD_CONFIGS = ["aws-a100.yaml", "gcp-a100.yaml"]


def load(name: str) -> dict:
    return yaml.safe_load((CLUSTER / name).read_text())


def ray_validated(config: dict) -> dict:
    """What `ray up` does before launching anything: fill in the provider's defaults, then validate."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def test_installed_ray_is_the_pinned_version():
    assert ray.__version__ == RAY_VERSION


@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_cloud_config_passes_ray_validation(name):
    prepared = ray_validated(load(name))
    assert prepared["head_node_type"] in prepared["available_node_types"]


def test_local_config_passes_ray_validation(monkeypatch):
    config = load("local.yaml")
    # The autoscaler reads this file as it is (no defaults merged in), so it must be valid alone.
    validate_config(copy.deepcopy(config))
    # prepare_config needs the provider's defaults file, which the ray wheel lacks for
    # fake_multinode; local.yaml is written out in full, so it serves as its own defaults.
    monkeypatch.setitem(providers._DEFAULT_CONFIGS, "fake_multinode", lambda: str(CLUSTER / "local.yaml"))
    prepared = ray_validated(config)
    assert prepared["provider"]["type"] == "fake_multinode"
    # The fake provider names the head's type ray.head.default, whatever the config says.
    assert prepared["head_node_type"] == "ray.head.default"
    worker = prepared["available_node_types"]["cpu.worker"]
    assert worker["min_workers"] == 0 and worker["max_workers"] >= 1
    head_cpus = prepared["available_node_types"]["ray.head.default"]["resources"]["CPU"]
    assert worker["resources"]["CPU"] >= 1 and head_cpus < 2, "a 2-worker job must not fit on the head"


def test_a_broken_config_is_refused_by_the_same_validation():
    config = load("aws-a100.yaml")
    config["available_node_types"]["gpu.a100"]["resources"]["GPU"] = "eight"
    with pytest.raises(Exception, match="eight"):
        ray_validated(config)
    config = load("aws-a100.yaml")
    config["head_node_type"] = "no-such-type"
    with pytest.raises(ValueError, match="head_node_type"):
        ray_validated(config)


def gpu_worker_types(config: dict) -> dict:
    return {name: t for name, t in config["available_node_types"].items() if t["resources"].get("GPU", 0) > 0}


def test_aws_head_is_cpu_and_workers_are_p4d_scaling_from_zero_with_a_spot_option():
    config = load("aws-a100.yaml")
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and not head["node_config"]["InstanceType"].startswith(("p", "g"))
    workers = gpu_worker_types(config)
    assert {t["node_config"]["InstanceType"] for t in workers.values()} == {"p4d.24xlarge"}
    assert all(t["min_workers"] == 0 and t["resources"]["GPU"] == 8 for t in workers.values())
    assert max(t["max_workers"] for t in workers.values()) >= 2, "a 2-node job must be able to run"
    spot = [t for t in workers.values() if t["node_config"].get("InstanceMarketOptions", {}).get("MarketType") == "spot"]
    assert spot, "no spot worker type"
    # Nodes act through instance profiles, never keys.
    assert all("IamInstanceProfile" in t["node_config"] for t in config["available_node_types"].values())


def test_gcp_workers_are_a2_highgpu_scaling_from_zero_with_a_spot_option():
    config = load("gcp-a100.yaml")
    workers = gpu_worker_types(config)
    assert all(t["node_config"]["machineType"].startswith("a2-highgpu") for t in workers.values())
    assert all(t["min_workers"] == 0 for t in workers.values())
    assert all(t["node_config"]["scheduling"]["onHostMaintenance"] == "TERMINATE" for t in workers.values())
    assert any(t["node_config"]["scheduling"].get("provisioningModel") == "SPOT" for t in workers.values())


@pytest.mark.parametrize("name", CLOUD_CONFIGS)
def test_cloud_config_pins_the_image_caches_and_installs_the_project(name):
    config = load(name)
    assert config["docker"]["worker_image"] == GPU_IMAGE
    assert config["docker"]["head_image"].startswith(f"rayproject/ray:{RAY_VERSION}-py311")
    run_options = " ".join(config["docker"]["run_options"])
    assert "TRITON_CACHE_DIR=/tmp/nsa-cache/triton" in run_options
    assert "TORCHINDUCTOR_CACHE_DIR=/tmp/nsa-cache/inductor" in run_options
    assert "/tmp/nsa-cache:/tmp/nsa-cache" in run_options, "the caches must live on the node, not in a shared store"
    assert any("constraints.txt" in c and "pip install" in c for c in config["setup_commands"])
    # The dashboard (the job API) is not exposed beyond the head.
    assert "--dashboard-host=127.0.0.1" in " ".join(config["head_start_ray_commands"])


CREDENTIAL_PATTERNS = [
    r"AKIA[0-9A-Z]{16}",                      # AWS access key id
    r"aws_secret_access_key", r"aws_access_key_id",
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----",
    r"ssh_private_key\s*:",
    r"\"private_key\"",                         # GCP service-account key JSON
    r"(?i)password\s*[:=]\s*(?![\"']?\$)\S+",   # a literal password (a $VARIABLE expansion is fine)
    r"postgres(ql)?://[^\s:@/]+:[^\s@/]+@",     # a password inside a database URI
]


def all_cluster_files() -> list[Path]:
    return [p for p in CLUSTER.rglob("*") if p.is_file() and "__pycache__" not in p.parts]


def test_no_credentials_in_any_cluster_file():
    files = all_cluster_files()
    assert len(files) >= 8
    for path in files:
        text = path.read_text()
        for pattern in CREDENTIAL_PATTERNS:
            match = re.search(pattern, text)
            # serve.py's checks and messages talk about passwords ("holds a password: remove it").
            if match and path.suffix == ".py" and "password" in pattern:
                continue
            assert match is None, f"{path.relative_to(REPO)} holds what looks like a credential: {match.group(0)!r}"


@pytest.mark.parametrize("planted", [
    "aws_access_key_id = AKIAABCDEFGHIJKLMNOP",
    "-----BEGIN RSA PRIVATE KEY-----",
    "admin_password = hunter22",
    "backend: postgresql://mlflow:hunter22@db:5432/mlflow",
])
def test_credential_scan_catches_a_planted_credential(planted):
    assert any(re.search(p, planted) for p in CREDENTIAL_PATTERNS)


def test_credential_scan_allows_a_variable_expansion():
    assert not any(re.search(p, 'MLFLOW_AUTH_ADMIN_PASSWORD="$(read-secret)"') for p in CREDENTIAL_PATTERNS)


# ---- KubeRay ----

def kuberay_documents(name: str) -> dict:
    docs = [d for d in yaml.safe_load_all((CLUSTER / "kuberay" / name).read_text()) if d]
    return {d["kind"]: d for d in docs}


def check_ray_cluster_spec(spec: dict) -> None:
    assert spec["rayVersion"] == RAY_VERSION
    assert spec["enableInTreeAutoscaling"] is True
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0", "no training on the head"
    head_container = head["template"]["spec"]["containers"][0]
    assert head_container["image"].endswith(f"nsa-pretrain:{RAY_VERSION}-py311-gpu")
    assert {"configMapRef": {"name": "nsa-mlflow"}} in head_container["envFrom"]
    (group,) = spec["workerGroupSpecs"]
    assert group["minReplicas"] == 0 and group["maxReplicas"] >= 2
    worker = group["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "8"
    env = {e["name"]: e["value"] for e in worker["env"]}
    assert env["TRITON_CACHE_DIR"].startswith("/tmp/nsa-cache") and env["TORCHINDUCTOR_CACHE_DIR"].startswith("/tmp/nsa-cache")
    mounts = {m["mountPath"]: m["name"] for m in worker["volumeMounts"]}
    volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp/nsa-cache"]], "the compile caches must be node-local"
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert group["template"]["spec"]["serviceAccountName"] == "nsa-ray"


def test_raycluster_manifest_is_complete():
    docs = kuberay_documents("raycluster.yaml")
    assert docs["RayCluster"]["apiVersion"] == "ray.io/v1"
    check_ray_cluster_spec(docs["RayCluster"]["spec"])
    assert docs["ConfigMap"]["data"]["MLFLOW_TRACKING_URI"].startswith("http")
    assert "eks.amazonaws.com/role-arn" in docs["ServiceAccount"]["metadata"]["annotations"]


def test_rayjob_manifest_holds_what_a_job_needs():
    job = kuberay_documents("rayjob.yaml")["RayJob"]
    assert job["apiVersion"] == "ray.io/v1"
    spec = job["spec"]
    capacity, train = spec["entrypoint"].split("&&")
    assert capacity.split()[:2] == ["python", "cluster/request_capacity.py"]
    entrypoint = train.split()
    assert entrypoint[:2] == ["python", "jobs/pretrain.py"]
    workers = next(int(a.split("=")[1]) for a in entrypoint if a.startswith("train.num_workers="))
    assert f"--workers {workers} --gpus-per-worker 1" in capacity, "the capacity asked must match the workers trained"
    dockerfile = (REPO / "cluster/docker/Dockerfile").read_text()
    assert "COPY --chown=ray:users jobs ./jobs" in dockerfile and "COPY --chown=ray:users cluster ./cluster" in dockerfile
    assert any(arg.startswith("train.storage_path=s3://") for arg in entrypoint), "checkpoints must go to shared storage"
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert runtime_env["working_dir"] == "/home/ray/nsa"
    assert spec["shutdownAfterJobFinishes"] is True
    check_ray_cluster_spec(spec["rayClusterSpec"])


def test_rayjob_runs_on_the_same_cluster_spec_as_the_raycluster():
    cluster_spec = kuberay_documents("raycluster.yaml")["RayCluster"]["spec"]
    job_spec = kuberay_documents("rayjob.yaml")["RayJob"]["spec"]["rayClusterSpec"]
    assert job_spec == cluster_spec


def test_project_image_is_built_on_the_pinned_ray_image():
    dockerfile = (CLUSTER / "docker/Dockerfile").read_text()
    assert re.search(rf"^FROM {re.escape(GPU_IMAGE)}$", dockerfile, re.MULTILINE)
    assert "-c constraints.txt" in dockerfile
