"""A real S3 endpoint for tests: moto's threaded server on 127.0.0.1.

``s3_server`` (session scope) starts ``moto.server.ThreadedMotoServer`` on a free port, points the
standard AWS environment variables at it (fake keys, region us-east-1, ``AWS_ENDPOINT_URL``),
creates the bucket ``ppoflow-test``, clears s3fs's instance cache so no filesystem made earlier
keeps an old endpoint, and yields ``{"endpoint_url": ..., "bucket": "ppoflow-test",
"url": "s3://ppoflow-test"}``. At the end the server stops and the environment is restored.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest

from tests.support.ports import free_port

BUCKET = "ppoflow-test"
_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
)


@contextlib.contextmanager
def aws_env(endpoint: str, bucket: str, **extra: str) -> Iterator[None]:
    """Inside the block the AWS_* variables (fake keys, us-east-1, ``extra``) point at ``endpoint``,
    where ``bucket`` exists; s3fs's instance cache is cleared on the way in and out, and the
    environment is restored after."""
    import s3fs

    names = _ENV + tuple(extra)
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
        **extra,
    )
    os.environ.pop("AWS_SESSION_TOKEN", None)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        try:
            s3fs.S3FileSystem().mkdir(bucket)
        except FileExistsError:  # moto's backends live in the process: an earlier server made it
            pass
        yield
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="session")
def s3_server() -> Iterator[dict]:
    """A running moto S3 server with bucket ``ppoflow-test``; AWS_* env vars point at it."""
    pytest.importorskip("moto.server")
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        with aws_env(endpoint, BUCKET):
            yield {"endpoint_url": endpoint, "bucket": BUCKET, "url": f"s3://{BUCKET}"}
    finally:
        server.stop()


@contextlib.contextmanager
def unpreempted_requests() -> Iterator[None]:
    """moto's server checks a conditional request's condition and then stores the object in two
    Python steps, so a thread switch between them (a server-side race real S3 does not have) could
    let two conditional PUTs of one key through. With a long switch interval each request's
    handling runs without preemption; clients still interleave freely (every network wait releases
    the GIL), so a client-side check-then-write still loses the races the tests look for."""
    import sys

    before = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        yield
    finally:
        sys.setswitchinterval(before)
