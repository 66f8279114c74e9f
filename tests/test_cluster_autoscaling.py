"""The autoscaler adds a node when a training job asks for more than the head has (cluster/local.yaml).

Starts Ray's fake_multinode cluster from cluster/local.yaml on this machine (a head with 1 CPU),
runs the real training job (jobs/pretrain.py, tiny model, 2 steps) with 2 Ray Train workers of
1 CPU each, and checks that the autoscaler launched `cpu.worker` nodes and that the job finished
(and logged to MLflow) across them. cluster/smoke_train.py, which reports each worker's node id,
checks the same by hand: RAY_ADDRESS=... python cluster/smoke_train.py -> "num_nodes": 2. Teardown ends exactly the
processes of this cluster (never `ray stop`, which would end every Ray cluster of this user on
the machine, other tests' included) and checks that none is left.
"""

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import yaml

from ports import free_ports

pytestmark = pytest.mark.xdist_group("ray")  # one Ray cluster at a time (pyproject.toml)

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))


class FakeCluster:
    """One fake_multinode Ray cluster, owned by this test: its own temp dir, ports and process group."""

    def __init__(self, workdir: Path):
        # Unix socket paths live under the temp dir and must stay short (about 100 characters).
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rfk", dir="/tmp"))
        self.port, self.dashboard_port, self.agent_port, self.client_port = free_ports(4)
        self.address = f"127.0.0.1:{self.port}"
        self.config_path = workdir / "local.yaml"
        self.leader_pid = None
        # Ray 2.60 turns on token authentication for `ray start --head` whenever ~/.ray/auth_token
        # exists (any earlier local ray.init() writes one), and a driver given an explicit address
        # only sends a token with RAY_AUTH_MODE=token. This cluster uses its own token, in its own
        # file, given to the head and to the job alike, so nothing depends on ~/.ray.
        self.token_path = str(self.temp_dir / "auth_token")
        Path(self.token_path).write_text(secrets.token_hex(32))
        Path(self.token_path).chmod(0o600)
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": self.token_path}

    def write_config(self) -> None:
        config = yaml.safe_load((REPO / "cluster/local.yaml").read_text())
        config["provider"]["gcs_address"] = self.address  # our own port, so no other cluster is touched
        self.config_path.write_text(yaml.safe_dump(config))

    def start(self) -> None:
        self.write_config()
        head_cpus = yaml.safe_load(self.config_path.read_text())["available_node_types"]["ray.head.default"]["resources"]["CPU"]
        command = [
            RAY, "start", "--head", f"--port={self.port}", f"--num-cpus={head_cpus}",
            f"--temp-dir={self.temp_dir}", f"--autoscaling-config={self.config_path}",
            "--include-dashboard=false", f"--dashboard-port={self.dashboard_port}",
            f"--dashboard-agent-listen-port={self.agent_port}", f"--ray-client-server-port={self.client_port}",
            "--object-store-memory=300000000", "--disable-usage-stats",
        ]
        # The fake provider refuses to run without RAY_FAKE_CLUSTER=1 (Ray's own guard for test clusters).
        env = {**self.env, "RAY_FAKE_CLUSTER": "1"}
        # A new session: the cluster's processes inherit this process group, one of the ways
        # teardown finds them all (see processes()).
        starter = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.leader_pid = starter.pid
        output, _ = starter.communicate(timeout=180)
        if starter.returncode != 0:
            raise RuntimeError(f"`ray start` failed ({starter.returncode}):\n{output}")

    def processes(self) -> list[psutil.Process]:
        """Every live process of this cluster, found four ways: its process group, its temp dir in the
        command line, this cluster's token path in the environment (inherited by every process the
        cluster starts, even one that changed its process group or title), and their descendants."""
        me = os.getpid()
        found = {}
        for proc in psutil.process_iter(["pid", "cmdline", "status"]):
            try:
                in_group = os.getpgid(proc.pid) == self.leader_pid
                names_temp_dir = any(str(self.temp_dir) in arg for arg in (proc.info["cmdline"] or []))
                has_our_token = proc.environ().get("RAY_AUTH_TOKEN_PATH") == self.token_path
            except (ProcessLookupError, psutil.Error):
                continue
            if (in_group or names_temp_dir or has_our_token) and proc.pid != me:
                found[proc.pid] = proc
        for proc in list(found.values()):
            try:
                for child in proc.children(recursive=True):
                    found.setdefault(child.pid, child)
            except psutil.NoSuchProcess:
                pass
        return [p for p in found.values() if is_alive(p)]

    def stop(self) -> None:
        procs = self.processes()
        for proc in procs:
            try:
                proc.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=15)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=10)

    def monitor_log(self) -> str:
        logs = list(self.temp_dir.glob("session_*/logs/monitor.log"))
        return "\n".join(p.read_text(errors="replace") for p in logs)


def is_alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (a zombie whose parent is init holds nothing and cannot be reaped by us)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def fake_cluster(tmp_path):
    cluster = FakeCluster(tmp_path)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)


def run_job(cluster: FakeCluster, args: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = {**cluster.env, "RAY_ADDRESS": cluster.address}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def wait_for(predicate, timeout: float, interval: float = 1.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def autoscaler_shows_active(cluster: FakeCluster, node_type: str) -> bool:
    """The autoscaler's status report in monitor.log lists an active node of this type."""
    return re.search(rf"Active:\n(?: \d+ \S+\n)*? \d+ {re.escape(node_type)}\n", cluster.monitor_log()) is not None


# The real training job, tiny and short: 2 Ray Train workers of 1 CPU each (the head has 1 CPU).
NUM_WORKERS, CPUS_PER_WORKER, MAX_STEPS = 2, 1, 2


def pretrain_args(work: Path) -> list[str]:
    overrides = {
        "train.num_workers": NUM_WORKERS, "train.cpus_per_worker": CPUS_PER_WORKER,
        "train.max_steps": MAX_STEPS, "train.warmup_steps": 1, "train.log_every": 1,
        "train.val_batches": 1, "train.checkpoint_every": 0,
        "train.run_name": "cluster-autoscaling", "train.storage_path": work / "ray_results",
        "tracking.tracking_uri": f"sqlite:///{work / 'mlflow.db'}", "tracking.system_metrics": "false",
    }
    return ["jobs/pretrain.py", *[a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]]


@pytest.mark.timeout(600)
def test_autoscaler_adds_a_node_and_the_training_job_completes_across_nodes(fake_cluster, tmp_path):
    from mlflow.tracking import MlflowClient

    config = yaml.safe_load(fake_cluster.config_path.read_text())
    head_cpus = config["available_node_types"]["ray.head.default"]["resources"]["CPU"]
    # The job cannot fit on the head: its workers' placement group must span the head and new nodes.
    assert NUM_WORKERS * CPUS_PER_WORKER > head_cpus
    assert "Adding" not in fake_cluster.monitor_log(), "a node was launched before any job asked for one"

    job = run_job(fake_cluster, pretrain_args(tmp_path), timeout=540)
    assert job.returncode == 0, f"job failed:\n{job.stdout[-4000:]}\n{job.stderr[-6000:]}"
    assert "done in" in job.stdout and f"step {MAX_STEPS}," in job.stdout, job.stdout[-3000:]

    # The autoscaler launched worker nodes for it, and they joined.
    assert "Adding 1 node(s) of type cpu.worker" in fake_cluster.monitor_log()
    assert wait_for(lambda: autoscaler_shows_active(fake_cluster, "cpu.worker"), timeout=30), fake_cluster.monitor_log()[-3000:]

    # Rank 0 (on whichever node) logged the run to MLflow, and it finished.
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "nsa-pretrain"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")][-1] == MAX_STEPS
    assert (tmp_path / "ray_results/cluster-autoscaling").is_dir()

    # Teardown ends every process of the cluster, the autoscaler-launched nodes' included.
    procs_while_running = fake_cluster.processes()
    assert sum(p.name() == "raylet" for p in procs_while_running) >= 2, "expected the head's raylet and a worker node's"
    fake_cluster.stop()
    left = [p for p in procs_while_running if is_alive(p)] + fake_cluster.processes()
    assert not left, f"processes left behind: {[(p.pid, p.name()) for p in left]}"
