"""Start an MLflow tracking server for this project: one machine (sqlite) or a team (Postgres + object store).

    python cluster/mlflow/serve.py local                      # sqlite:///outputs/mlflow.db, outputs/mlartifacts
    python cluster/mlflow/serve.py local --root /data/mlflow --port 5001
    python cluster/mlflow/serve.py team \
        --backend-store-uri postgresql://mlflow@db.internal:5432/mlflow \
        --artifacts-destination s3://my-bucket/mlflow --workers 4
    python cluster/mlflow/serve.py team ... --host 0.0.0.0 --auth-config cluster/mlflow/basic_auth.ini

The server listens on 127.0.0.1 unless told otherwise, and refuses any other address without basic
auth. It serves artifacts itself (clients need no object-store credentials; the server uses its
instance profile or service account). No password is read from or written to a file here:
Postgres takes its password from ~/.pgpass (libpq), and the basic-auth admin password is given once,
on the first start, through MLFLOW_AUTH_ADMIN_PASSWORD (see docs/runbook.md).

The checks run before anything starts; then this process becomes `mlflow server` (exec), so its
process id is the server's. Arguments after `--` go to `mlflow server` unchanged.
"""

import argparse
import configparser
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
OBJECT_STORE_CLIENTS = {"s3": "boto3", "gs": "google.cloud.storage"}


@dataclass(frozen=True)
class ServerConfig:
    backend_store_uri: str
    artifacts_destination: str
    host: str = "127.0.0.1"
    port: int = 5000
    workers: int = 1
    auth_config: str | None = None
    extra_args: list[str] = field(default_factory=list)

    def __post_init__(self):
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.host not in LOOPBACK_HOSTS and self.auth_config is None:
            raise ValueError(
                f"--host {self.host} would expose the tracking server without authentication: "
                "pass --auth-config (basic auth), or keep 127.0.0.1 and reach it through an SSH tunnel"
            )
        if self.auth_config is not None:
            check_auth_config(Path(self.auth_config))


def check_auth_config(path: Path) -> None:
    """Basic auth must be installed and its config file must not hold a password."""
    if not path.is_file():
        raise ValueError(f"--auth-config {path}: no such file (start from cluster/mlflow/basic_auth.ini)")
    parser = configparser.ConfigParser()
    parser.read(path)
    if "mlflow" not in parser:
        raise ValueError(f"--auth-config {path}: missing the [mlflow] section")
    for key in ("default_permission", "database_uri"):
        if not parser["mlflow"].get(key):
            raise ValueError(f"--auth-config {path}: [mlflow] {key} is not set")
    if parser["mlflow"].get("admin_password"):
        raise ValueError(
            f"--auth-config {path}: admin_password is set in the file; remove it and give the admin "
            "password once, on the first start, through MLFLOW_AUTH_ADMIN_PASSWORD"
        )
    if importlib.util.find_spec("flask_wtf") is None:
        raise ValueError("basic auth needs MLflow's auth extra: pip install 'mlflow[auth]'")


def local_config(root: str, host: str, port: int, auth_config: str | None, extra_args: list[str]) -> ServerConfig:
    """The project's default store (docs/DESIGN.md): <root>/mlflow.db and <root>/mlartifacts."""
    root_path = Path(root).resolve()
    root_path.mkdir(parents=True, exist_ok=True)
    return ServerConfig(
        backend_store_uri=f"sqlite:///{root_path / 'mlflow.db'}",
        artifacts_destination=str(root_path / "mlartifacts"),
        host=host, port=port, auth_config=auth_config, extra_args=extra_args,
    )


def team_config(backend_store_uri: str, artifacts_destination: str, host: str, port: int, workers: int,
                auth_config: str | None, extra_args: list[str]) -> ServerConfig:
    db = urlsplit(backend_store_uri)
    if not db.scheme.startswith("postgresql"):
        raise ValueError(f"--backend-store-uri must be a postgresql:// URI, got {backend_store_uri!r}")
    if db.password:
        raise ValueError("--backend-store-uri holds a password: remove it and put it in ~/.pgpass (libpq reads it)")
    if importlib.util.find_spec("psycopg2") is None:
        raise ValueError("a Postgres backend store needs psycopg2: pip install psycopg2-binary")
    store = urlsplit(artifacts_destination).scheme
    if store not in OBJECT_STORE_CLIENTS:
        raise ValueError(f"--artifacts-destination must be an object store ({', '.join(s + '://' for s in OBJECT_STORE_CLIENTS)}), got {artifacts_destination!r}")
    client = OBJECT_STORE_CLIENTS[store]
    if importlib.util.find_spec(client.split(".")[0]) is None:
        raise ValueError(f"{store}:// artifacts need {client}: pip install {'boto3' if store == 's3' else 'google-cloud-storage'}")
    return ServerConfig(backend_store_uri, artifacts_destination, host, port, workers, auth_config, extra_args)


def server_command(cfg: ServerConfig) -> list[str]:
    command = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", cfg.backend_store_uri,
        # The server proxies artifact uploads and downloads (mlflow-artifacts:/ URIs).
        "--serve-artifacts", "--artifacts-destination", cfg.artifacts_destination,
        "--host", cfg.host, "--port", str(cfg.port), "--workers", str(cfg.workers),
    ]
    if cfg.auth_config is not None:
        command += ["--app-name", "basic-auth"]
    return command + cfg.extra_args


def server_environment(cfg: ServerConfig) -> dict[str, str]:
    env = dict(os.environ)
    # MLflow's server-side job runner (GenAI judges, prompt optimisation) starts about seven
    # worker processes; this project logs runs and serves the UI only, so it stays off.
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    if cfg.auth_config is not None:
        env["MLFLOW_AUTH_CONFIG_PATH"] = str(Path(cfg.auth_config).resolve())  # MLflow's own setting
    return env


def parse_args(argv: list[str]) -> ServerConfig:
    extra_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    local = modes.add_parser("local", help="sqlite store and local artifacts, for one machine")
    local.add_argument("--root", default="outputs", help="folder of mlflow.db and mlartifacts/ (default: outputs)")
    team = modes.add_parser("team", help="Postgres store and object-store artifacts, for a team")
    team.add_argument("--backend-store-uri", required=True, help="postgresql://USER@HOST:PORT/DB (password in ~/.pgpass)")
    team.add_argument("--artifacts-destination", required=True, help="s3://BUCKET/PREFIX or gs://BUCKET/PREFIX")
    team.add_argument("--workers", type=int, default=4)
    for mode in (local, team):
        mode.add_argument("--host", default="127.0.0.1")
        mode.add_argument("--port", type=int, default=5000)
        mode.add_argument("--auth-config", default=None, help="basic-auth ini (see cluster/mlflow/basic_auth.ini)")
    args = parser.parse_args(argv)
    if args.mode == "local":
        return local_config(args.root, args.host, args.port, args.auth_config, extra_args)
    return team_config(args.backend_store_uri, args.artifacts_destination, args.host, args.port, args.workers,
                       args.auth_config, extra_args)


def main(argv: list[str]) -> None:
    try:
        cfg = parse_args(argv)
    except ValueError as error:
        sys.exit(f"serve.py: {error}")
    command = server_command(cfg)
    print("serve.py: " + " ".join(command), flush=True)
    os.execve(command[0], command, server_environment(cfg))


if __name__ == "__main__":
    main(sys.argv[1:])
