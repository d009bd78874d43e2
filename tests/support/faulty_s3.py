"""A real S3 endpoint that fails chosen requests on purpose: moto's server behind a WSGI layer.

    with faulty_s3() as s3:                      # AWS_* variables point at it inside the block
        s3.fail("PUT", r"/exp/manifest\\.json$", times=1000)
        ... run something ...
        s3.failed                                # [(method, path), ...] of the requests it failed
        s3.stall("PUT", r"/exp/lock\\.json$", seconds=8)   # answer those only after 8 s (a hung storage)
        s3.stalled                               # [(method, path), ...] of the requests it held

A failed request gets what S3 answers under trouble: HTTP 500 with an ``InternalError`` XML body
(the request body is read first, as a server that broke mid-upload would have). Everything else
goes to moto unchanged. ``AWS_MAX_ATTEMPTS=2`` and ``AWS_RETRY_MODE=standard`` are set, so each
storage call makes exactly two HTTP attempts before it raises: ``times=1`` is a hiccup the client
rides over, ``times=2`` fails one storage call.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from tests.support.ports import free_port
from tests.support.s3_server import aws_env

BUCKET = "ppoflow-faults"
_ERROR = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code><Message>We encountered '
    b"an internal error. Please try again.</Message><RequestId>ppoflow-fault</RequestId></Error>"
)


@dataclass
class Rule:
    method: str
    pattern: re.Pattern
    times: int
    skip: int = 0


class FaultyS3:
    """WSGI middleware in front of moto (see the module docstring)."""

    def __init__(self, app):
        self.app = app
        self.rules: list[Rule] = []
        self.stalls: list[tuple[str, re.Pattern, float]] = []
        self.failed: list[tuple[str, str]] = []
        self.stalled: list[tuple[str, str]] = []
        self.passed: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self.endpoint = ""

    def fail(self, method: str, pattern: str, times: int, skip: int = 0) -> None:
        """Fail the next ``times`` ``method`` requests whose path matches ``pattern``, after letting
        ``skip`` of them through."""
        with self._lock:
            self.rules.append(Rule(method, re.compile(pattern), times, skip))

    def stall(self, method: str, pattern: str, seconds: float) -> None:
        """Hold every ``method`` request whose path matches ``pattern`` for ``seconds`` before
        answering it (a storage that hangs)."""
        with self._lock:
            self.stalls.append((method, re.compile(pattern), float(seconds)))

    def clear(self) -> None:
        with self._lock:
            self.rules, self.stalls = [], []

    def _should_fail(self, method: str, path: str) -> bool:
        with self._lock:
            for rule in self.rules:
                if rule.method == method and rule.pattern.search(path) and rule.times > 0:
                    if rule.skip > 0:
                        rule.skip -= 1
                        return False
                    rule.times -= 1
                    self.failed.append((method, path))
                    return True
            return False

    def __call__(self, environ, start_response):
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        with self._lock:
            hold = max((s for m, p, s in self.stalls if m == method and p.search(path)), default=0.0)
        if hold:
            with self._lock:
                self.stalled.append((method, path))
            time.sleep(hold)
        if self._should_fail(method, path):
            length = int(environ.get("CONTENT_LENGTH") or 0)
            if length:
                environ["wsgi.input"].read(length)
            start_response(
                "500 Internal Server Error",
                [("Content-Type", "application/xml"), ("Content-Length", str(len(_ERROR)))],
            )
            return [_ERROR]
        if method == "PUT":
            with self._lock:
                self.passed.append((method, path))
        return self.app(environ, start_response)


@contextlib.contextmanager
def faulty_s3() -> Iterator[FaultyS3]:
    """A moto server behind :class:`FaultyS3` with bucket :data:`BUCKET`; AWS_* point at it."""
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    port = free_port()
    faults = FaultyS3(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", port, faults, threaded=True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, name="faulty-s3", daemon=True)
    thread.start()
    faults.endpoint = f"http://127.0.0.1:{port}"
    try:
        with aws_env(faults.endpoint, BUCKET, AWS_MAX_ATTEMPTS="2", AWS_RETRY_MODE="standard"):
            yield faults
    finally:
        server.shutdown()
        thread.join(10)
