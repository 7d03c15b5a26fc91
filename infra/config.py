"""Typed settings of the infrastructure layer: object storage and the Ray connection."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

# Each numeric setting has both ends (a range a real run could use; tests/test_config.py walks them).
DAY_S = 86400.0
HOUR_S = 3600.0


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class StorageConfig(_Section):
    root: str = Field("./runs", description="fsspec URL of the storage root: a folder or s3://bucket/prefix")
    endpoint_url: str | None = Field(None, description="S3 endpoint; default: AWS_ENDPOINT_URL or AWS")
    region: str | None = Field(None, description="S3 region; default: AWS_DEFAULT_REGION")
    access_key_id: SecretStr | None = Field(None, description="default: AWS_ACCESS_KEY_ID; never logged")
    secret_access_key: SecretStr | None = Field(None, description="default: AWS_SECRET_ACCESS_KEY; never logged")
    shared_fs: bool = Field(False, description="a local root that every Ray node mounts (NFS, Lustre): only then "
                            "may a multi-node cluster use a local root")
    keep_last: int = Field(3, ge=1, le=10_000, description="committed checkpoints kept")
    keep_every: int = Field(0, ge=0, le=10**7, description="also keep every M-th step (0: none)")
    lease_ttl_s: float = Field(300.0, ge=10, le=DAY_S, description="writer lease expiry unless renewed (it is "
                               "renewed every third of it)")
    retry_attempts: int = Field(8, ge=1, le=100, description="tries for a transient storage failure")
    retry_max_wait_s: float = Field(8.0, ge=0.01, le=HOUR_S, description="cap of the exponential backoff")
    connect_timeout_s: float = Field(
        10.0, ge=0.1, le=HOUR_S, description="S3: a connection not made by then is retried")
    read_timeout_s: float = Field(
        60.0, ge=0.1, le=HOUR_S, description="S3: a silent server (hung) is retried after this")
    max_concurrency: int = Field(8, ge=1, le=1024, description="parallel object transfers (checkpoint shards)")


class RayConfig(_Section):
    address: str | None = Field(
        None, description="a Ray cluster address; default: the local head node that `rlflow up` starts"
    )
    namespace: str = "rlflow"
    max_concurrent_stages: int = Field(
        4, ge=1, le=1024, description="stage tasks running at once (a custom resource)")
    placement: Literal["pack", "spread", "strict_pack", "strict_spread"] = Field(
        "pack", description="the Ray placement-group strategy of each pool's ranks (strict_spread: one rank a node)"
    )


class StackConfig(_Section):
    """The local stack that `rlflow up` starts: a Prefect API server and a Ray head node (infra/stack.py)."""

    home: str | None = Field(
        default=None,
        description="state folder (PIDs, logs, Prefect's SQLite); default: $RLFLOW_HOME or ~/.rlflow",
    )
    prefect_port: int = Field(default=4200, ge=1, le=65535, description="the Prefect server on 127.0.0.1")
    prefect_api_url: str | None = Field(
        default=None,
        description="an external Prefect API (scale-out: a server with PostgreSQL); default: the local server",
    )
    ray_port: int = Field(default=6379, ge=1, le=65535, description="the Ray head's GCS port")
    num_cpus: int | None = Field(
        default=None,
        ge=0,
        le=2**20,
        description="the Ray node's logical CPUs; default: max(cores, 4), the engine's rank actors need 4 "
        "(0: a head that runs no rank, as a cluster's head often does)",
    )
    join: str | None = Field(
        default=None,
        description="127.0.0.1:PORT of another stack's Ray head: this state folder runs a Ray worker node "
        "of that cluster (with the stage resource) instead of a stack of its own",
    )
    join_token_file: str | None = Field(
        default=None,
        description="with join: the head's Ray token file (its state folder's stack/ray_auth_token); "
        "default: $RAY_AUTH_TOKEN_PATH, else no token",
    )
    ray_auth: Literal["token", "disabled"] = Field(
        default="token",
        description="Ray token authentication of the head; the token lives in the state folder",
    )
    start_timeout_s: float = Field(
        default=180.0, gt=0, le=DAY_S, description="a service not healthy by then fails `up`"
    )
    stop_timeout_s: float = Field(
        default=20.0, gt=0, le=HOUR_S, description="after SIGTERM, wait this long before SIGKILL"
    )
