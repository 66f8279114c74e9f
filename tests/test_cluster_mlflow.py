"""The MLflow server script (cluster/mlflow/serve.py): its checks, and a real sqlite server over HTTP."""

import importlib.util
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from ports import free_ports

REPO = Path(__file__).resolve().parents[1]
SERVE = REPO / "cluster/mlflow/serve.py"


def load_serve():
    spec = importlib.util.spec_from_file_location("mlflow_serve", SERVE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


serve = load_serve()


# ---- checks made before anything starts ----

def test_local_defaults_to_loopback_and_the_project_store(tmp_path):
    cfg = serve.parse_args(["local", "--root", str(tmp_path)])
    command = serve.server_command(cfg)
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--backend-store-uri") + 1] == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert command[command.index("--artifacts-destination") + 1] == str(tmp_path / "mlartifacts")
    assert "--app-name" not in command


def test_public_host_without_auth_is_refused(tmp_path):
    with pytest.raises(ValueError, match="without authentication"):
        serve.parse_args(["local", "--root", str(tmp_path), "--host", "0.0.0.0"])


def test_auth_config_with_a_password_is_refused(tmp_path):
    ini = tmp_path / "auth.ini"
    ini.write_text((REPO / "cluster/mlflow/basic_auth.ini").read_text() + "admin_password = password1234\n")
    with pytest.raises(ValueError, match="admin_password is set"):
        serve.check_auth_config(ini)


def test_shipped_auth_config_holds_no_password():
    import configparser
    parser = configparser.ConfigParser()
    parser.read(REPO / "cluster/mlflow/basic_auth.ini")
    assert parser["mlflow"]["admin_username"] == "admin"
    assert not parser["mlflow"].get("admin_password")


def test_team_store_refuses_passwords_and_non_object_stores():
    with pytest.raises(ValueError, match="pgpass"):
        serve.team_config("postgresql://mlflow:secret@db:5432/mlflow", "s3://b/mlflow", "127.0.0.1", 5000, 4, None, [])
    with pytest.raises(ValueError, match="postgresql"):
        serve.team_config("sqlite:///x.db", "s3://b/mlflow", "127.0.0.1", 5000, 4, None, [])
    if importlib.util.find_spec("psycopg2") is not None:
        with pytest.raises(ValueError, match="object store"):
            serve.team_config("postgresql://mlflow@db:5432/mlflow", "/tmp/artifacts", "127.0.0.1", 5000, 4, None, [])


def test_bad_arguments_exit_with_a_message_naming_the_problem(tmp_path):
    result = subprocess.run([sys.executable, str(SERVE), "local", "--root", str(tmp_path), "--port", "70000"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "--port must be in 1..65535" in result.stderr


# ---- a real server ----

def wait_healthy(url: str, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited early ({server.returncode}):\n{server.stdout.read()}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"no healthy MLflow server at {url} after {timeout}s")


def stop_group(server: subprocess.Popen) -> list[psutil.Process]:
    """End the server's process group (it was started as a new session); return what survived."""
    group = [p for p in psutil.process_iter() if _pgid(p.pid) == server.pid]
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=10)
    _, alive = psutil.wait_procs(group, timeout=10)
    return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


@pytest.mark.timeout(360)
def test_sqlite_server_logs_and_reads_back_a_run_over_http(tmp_path):
    from mlflow.tracking import MlflowClient

    port, = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, str(SERVE), "local", "--root", str(tmp_path / "store"), "--port", str(port)],
                              cwd=tmp_path, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(url, server, timeout=240)  # a few seconds on a quiet machine; minutes on a loaded one

        # Bound to loopback only.
        group = [p for p in psutil.process_iter() if _pgid(p.pid) == server.pid]
        listening = {c.laddr for p in group for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
        assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening

        client = MlflowClient(tracking_uri=url)
        experiment_id = client.create_experiment("cluster-test")
        run = client.create_run(experiment_id, run_name="over-http")
        client.log_param(run.info.run_id, "n_selected", "16")
        for step, loss in enumerate([4.0, 3.5, 3.25]):
            client.log_metric(run.info.run_id, "train_loss", loss, step=step)
        client.log_text(run.info.run_id, "hello from the cluster test", "notes/hello.txt")
        client.set_terminated(run.info.run_id)

        fetched = MlflowClient(tracking_uri=url).get_run(run.info.run_id)
        assert fetched.data.params == {"n_selected": "16"}
        history = client.get_metric_history(run.info.run_id, "train_loss")
        assert [(m.step, m.value) for m in history] == [(0, 4.0), (1, 3.5), (2, 3.25)]
        assert fetched.info.status == "FINISHED"
        downloaded = client.download_artifacts(run.info.run_id, "notes/hello.txt", str(tmp_path))
        assert Path(downloaded).read_text() == "hello from the cluster test"

        # The store is where the script said: sqlite file and proxied artifacts under --root.
        assert (tmp_path / "store/mlflow.db").is_file()
        assert list((tmp_path / "store/mlartifacts").rglob("hello.txt"))
    finally:
        left = stop_group(server)
    assert not left, f"server processes left behind: {[(p.pid, p.name()) for p in left]}"
