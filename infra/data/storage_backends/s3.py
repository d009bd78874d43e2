"""``s3://`` (and ``s3a://``) through s3fs: S3's own conditional requests.

- create-if-absent: one ``PutObject`` with ``If-None-Match: *`` (S3 refuses it with 412 when the
  key exists, and with 409 while another conditional write of the key is in flight).
- replace-if-match: one ``PutObject`` with ``If-Match: <ETag>``; delete-if-match: one
  ``DeleteObject`` with ``If-Match: <ETag>``. (An S3-compatible store that ignores ``If-Match``
  on deletes deletes unconditionally; the lock only deletes its own, just-read version.)
- version token: the object's ETag; ``read_versioned`` takes content and ETag from one
  ``GetObject``, so the token is the very version read.
- atomic publish: the final key is written directly. An S3 object becomes visible only when its
  single PUT or its multipart upload completes, so a reader sees the old object or the whole new
  one; on an exception the upload is aborted (``S3File.discard``) and nothing is published. This
  avoids the copy + delete a temporary key would cost (a full server-side copy of the object).

Endpoint and credentials are s3fs's (the ``AWS_*`` environment variables, or storage options).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import IO, Any

from fsspec.asyn import sync

from ppoflow.infra.data.storage_backends.base import StorageBackend

__all__ = ["S3Backend"]

#: S3 error codes that mean "the condition did not hold" (not a failure of the storage).
_CONDITION_FAILED = {"PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey"}


def _condition_failed(exc: BaseException) -> bool:
    """Whether s3fs's exception ``exc`` is S3 refusing a conditional request."""
    if isinstance(exc, (FileExistsError, FileNotFoundError)):
        return True
    response = getattr(exc.__cause__, "response", None) or {}
    return response.get("Error", {}).get("Code") in _CONDITION_FAILED


class S3Backend(StorageBackend):
    """S3 through s3fs (see the module docstring)."""

    def _key(self, url: str) -> tuple[str, str, str]:
        path = self.path(url)
        bucket, key, _ = self.fs.split_path(path)
        return path, bucket, key

    def _put(self, url: str, data: bytes, **condition: str) -> str | None:
        path, bucket, key = self._key(url)
        try:
            out = self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
        except OSError as exc:
            if "IfNoneMatch" in condition and isinstance(exc, FileNotFoundError):
                raise  # no such bucket: nothing to compete with
            if _condition_failed(exc):
                return None
            raise
        finally:
            self.fs.invalidate_cache(path)
        return out["ETag"]

    def create(self, url: str, data: bytes) -> str | None:
        return self._put(url, data, IfNoneMatch="*")

    def replace(self, url: str, data: bytes, token: str) -> str | None:
        return self._put(url, data, IfMatch=token)

    def read_versioned(self, url: str) -> tuple[bytes, str]:
        _, bucket, key = self._key(url)

        async def get() -> tuple[bytes, str]:
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
            try:
                return await resp["Body"].read(), resp["ETag"]
            finally:
                resp["Body"].close()

        return sync(self.fs.loop, get)

    def delete(self, url: str, token: str) -> bool:
        path, bucket, key = self._key(url)
        try:
            self.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=token)
        except OSError as exc:
            if _condition_failed(exc):
                return False
            raise
        finally:
            self.fs.invalidate_cache(path)
        return True

    @contextlib.contextmanager
    def open_atomic(self, url: str, *, fsync: bool = False) -> Iterator[IO[bytes]]:
        f: Any = self.fs.open(self.path(url), "wb")
        try:
            yield f
        except BaseException:
            # Abort the multipart upload (if one started) and never PUT the buffer.
            f.discard()
            f.closed = True
            raise
        f.close()
