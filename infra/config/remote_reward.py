"""``reward.remote``: a reward service over HTTP that scores every row (docs/tasks.md#a-reward-service).

The config names where the credentials are, never the credentials: a bearer token comes from the
environment variable ``token_env`` or the Prefect Secret block ``token_secret`` when the scorer
is built, so no token is in a config file, in the config an experiment stores, or in an artifact.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from ppoflow.infra.config.names import Section

__all__ = ["RemoteRewardConfig"]


class RemoteRewardConfig(Section):
    """Where the service is and how to call it: POST ``endpoint`` with ``{"requests": [...]}``
    (``batch_size`` rows a request, ``concurrency`` requests at once), read ``{"scores": [...]}``."""

    endpoint: str = Field(description="http(s)://host:port/path that scores a batch")
    batch_size: int = Field(64, ge=1, description="rows per request")
    concurrency: int = Field(4, ge=1, description="requests in flight at once")
    timeout_s: float = Field(60.0, gt=0, description="seconds to wait for one response (read and connect)")
    retries: int = Field(
        3,
        ge=0,
        description="retries of a request after a transient failure (connection, timeout, 5xx, 429, bad JSON)",
    )
    backoff_s: float = Field(1.0, ge=0, description="the first retry's delay; doubles each retry")
    backoff_max_s: float = Field(30.0, ge=0, description="the longest delay between retries")
    token_env: str | None = Field(
        "PPOFLOW_REWARD_TOKEN",
        description="environment variable holding a bearer token (unset or empty: none from there)",
    )
    token_secret: str | None = Field(
        None,
        description="name of a Prefect Secret block holding the bearer token (used when token_env gives none)",
    )
    ca_bundle: str | None = Field(
        None, description="a CA bundle file to verify the service's TLS certificate"
    )
    client_cert: str | None = Field(
        None, description="a PEM file (certificate and key) for TLS client authentication"
    )
    verify_tls: bool = Field(True, description="false: do not verify the service's certificate (tests only)")

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http(s):// URL with a host")
        if parts.username or parts.password:
            raise ValueError(
                "the endpoint holds credentials (user:password@); they would be stored with the config: "
                "put a bearer token in the environment variable named by reward.remote.token_env, or in a "
                "Prefect Secret block named by reward.remote.token_secret"
            )
        return url

    @model_validator(mode="after")
    def _tls(self) -> RemoteRewardConfig:
        if self.ca_bundle and not self.verify_tls:
            raise ValueError("reward.remote: ca_bundle with verify_tls=false; drop one of them")
        return self
