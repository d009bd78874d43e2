"""A real S3 endpoint for tests: moto's threaded server on 127.0.0.1.

``s3_server`` (session scope) starts ``moto.server.ThreadedMotoServer`` on a free port, points the
standard AWS environment variables at it (fake keys, region us-east-1, ``AWS_ENDPOINT_URL``),
creates the bucket ``ppoflow-test``, clears s3fs's instance cache so no filesystem made earlier
keeps an old endpoint, and yields ``{"endpoint_url": ..., "bucket": "ppoflow-test",
"url": "s3://ppoflow-test"}``. At the end the server stops and the environment is restored.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

BUCKET = "ppoflow-test"
_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _clear_s3fs_cache() -> None:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[dict]:
    """A running moto S3 server with bucket ``ppoflow-test``; AWS_* env vars point at it."""
    pytest.importorskip("moto.server")
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    saved = {name: os.environ.get(name) for name in _ENV}
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
    )
    os.environ.pop("AWS_SESSION_TOKEN", None)
    _clear_s3fs_cache()
    try:
        import s3fs

        s3fs.S3FileSystem().mkdir(BUCKET)
        yield {"endpoint_url": endpoint, "bucket": BUCKET, "url": f"s3://{BUCKET}"}
    finally:
        _clear_s3fs_cache()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.stop()
