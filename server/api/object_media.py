"""`--media-store s3://bucket/prefix`: the videos' files as objects in S3-compatible storage, through boto3.

    <prefix>/videos/<id>.mp4                      a completed video (put whole: an object is complete or absent)
    <prefix>/videos/<id>.png                      its thumbnail
    <prefix>/videos/<id>.f<fence>.part/<n>        the n-th piece of a running claim's MP4, in order (`PartUploader`)
    <prefix>/inputs/<id>/<name>                   a job's uploaded input (an image, a video to extend)

A replica still encodes to a file of its own (`<data-dir>/videos`, its working area and a cache of what it
served). While a claim writes, `PartUploader` puts each piece appended to its `.part` file as an object of its own;
another replica's `?stream=true` reads the pieces in order (`ObjectTail`) and, once the record says completed, the
rest of the whole object from where the pieces ended. Publication (`PostgresJobStore.publish`) puts the thumbnail,
then the MP4, under their final names while it holds the job's row locked and checks the fence: a completed record
always names complete objects, and a claim that lost its lease never writes them. `GET /content` on a replica that
did not make the video fetches the object once into its cache (`StoredFiles.content_file`).

Where the server is: the standard AWS settings (`AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` for an S3-compatible
server such as MinIO or Ceph, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, or a role), as boto3
reads them. The bucket must exist: the server checks it at start.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from pathlib import Path
from urllib.parse import urlsplit

log = logging.getLogger("longserve.server")

#: the most bytes of one streamed piece (a piece holds what the encoder appended since the last one, up to this)
PIECE_BYTES = 8 << 20
#: what a remote reader reads of a whole object at a time
CHUNK_BYTES = 1 << 20
#: how often an uploader looks at its file, and a remote reader at the next piece
POLL_S = 0.25


def parse_s3_url(url: str) -> tuple[str, str]:
    """(bucket, prefix without slashes at its ends) of s3://bucket[/prefix]; ValueError naming media_store."""
    parts = urlsplit(url)
    bucket, prefix = parts.netloc, parts.path.strip("/")
    if parts.scheme != "s3" or not bucket or parts.query or parts.fragment:
        raise ValueError(f"media_store must be s3://bucket[/prefix], got {url!r}")
    return bucket, prefix


class ObjectMedia:
    """The bucket's objects under the prefix, named relative to it (`videos/<id>.mp4`). Thread-safe (boto3's client
    is); every call is blocking I/O (the io thread, a thread pool)."""

    def __init__(self, url: str):
        try:
            import boto3
            from botocore.config import Config
        except ImportError as e:
            raise ValueError("media_store: s3:// needs boto3 (pip install 'longserve[s3]')") from e
        from botocore.exceptions import BotoCoreError, ClientError

        self.bucket, self.prefix = parse_s3_url(url)
        self.url = url
        self._errors = (BotoCoreError, ClientError)
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        self.client = boto3.session.Session().client(
            "s3", region_name=region,
            config=Config(retries={"max_attempts": 4, "mode": "standard"}, max_pool_connections=32,
                          connect_timeout=10, read_timeout=60))
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except self._errors as e:
            raise ValueError(f"media_store: the bucket of {url!r} cannot be reached ({e}); set AWS_ENDPOINT_URL_S3 "
                             f"for an S3-compatible server, and the credentials") from None

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _missing(self, e: Exception) -> bool:
        code = getattr(e, "response", {}).get("Error", {}).get("Code", "")
        return code in ("404", "NoSuchKey", "NotFound", "InvalidRange", "416")

    def put_file(self, path: Path, name: str) -> None:
        """`path`'s bytes as the object `name` (a multipart upload for a large file; visible only once whole)."""
        self.client.upload_file(str(path), self.bucket, self.key(name))

    def put_bytes(self, name: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.key(name), Body=data)

    def get_bytes(self, name: str, start: int = 0) -> bytes | None:
        """The object's bytes from `start` on; None when there is no such object (or nothing from `start`)."""
        args = {"Range": f"bytes={start}-"} if start else {}
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.key(name), **args)["Body"].read()
        except self._errors as e:
            if self._missing(e):
                return None
            raise

    def open_from(self, name: str, start: int = 0):
        """A readable stream of the object's bytes from `start` on (`.read(n)`, `.close()`); None when there is no
        such object (or nothing from `start`)."""
        args = {"Range": f"bytes={start}-"} if start else {}
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.key(name), **args)["Body"]
        except self._errors as e:
            if self._missing(e):
                return None
            raise

    def get_file(self, name: str, path: Path) -> bool:
        """The object `name` into `path` (written beside it, then renamed: a reader sees all of it or nothing);
        False when there is no such object."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.dl")
        try:
            self.client.download_file(self.bucket, self.key(name), str(tmp))
        except self._errors as e:
            tmp.unlink(missing_ok=True)
            if self._missing(e):
                return False
            raise
        os.replace(tmp, path)
        return True

    def size(self, name: str) -> int | None:
        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=self.key(name))["ContentLength"])
        except self._errors as e:
            if self._missing(e):
                return None
            raise

    def copy(self, source: str, name: str) -> None:
        """A server-side copy; FileNotFoundError when `source` is gone."""
        try:
            self.client.copy_object(Bucket=self.bucket, Key=self.key(name),
                                    CopySource={"Bucket": self.bucket, "Key": self.key(source)})
        except self._errors as e:
            if self._missing(e):
                raise FileNotFoundError(source) from None
            raise

    def delete_prefix(self, prefix: str) -> int:
        """Every object whose name starts with `prefix`; how many."""
        removed = 0
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.key(prefix)):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", ())]
            if keys:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})
                removed += len(keys)
        return removed


def piece_name(video_id: str, fence: int, n: int) -> str:
    return f"videos/{video_id}.f{int(fence)}.part/{n:08d}"


class PartUploader:
    """Puts what a `FragmentedMP4Writer` appends to its `.part` file as numbered pieces (`piece_name`), until the
    writer is done or `stop()`: what other replicas stream while the job runs. A failed put stops it (a reader then
    waits for the whole object)."""

    def __init__(self, objects: ObjectMedia, video_id: str, fence: int, writer):
        self.objects, self.video_id, self.fence, self.writer = objects, video_id, fence, writer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"s3-pieces-{video_id}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        try:
            with open(self.writer.part_path, "rb") as f:
                n = 0
                while not self._stop.is_set():
                    done = self.writer.done.is_set()
                    data = f.read(PIECE_BYTES)
                    if data:
                        self.objects.put_bytes(piece_name(self.video_id, self.fence, n), data)
                        n += 1
                    elif done:           # the rest is published whole
                        return
                    else:
                        self._stop.wait(POLL_S)
        except FileNotFoundError:
            return                       # aborted before it began
        except Exception as e:  # noqa: BLE001 - the stream elsewhere then waits for the whole object
            log.warning("%s: uploading its pieces failed: %s", self.video_id, e)


class ObjectTail:
    """`?stream=true` on a replica that does not run the job: the pieces another replica puts, in order, then the
    rest of the published object. `state()` says 'running', 'completed' or 'gone' (failed, deleted, another claim)."""

    def __init__(self, objects: ObjectMedia, video_id: str, fence: int, state):
        self.objects, self.video_id, self.fence, self.state = objects, video_id, fence, state

    async def stream(self):
        loop = asyncio.get_running_loop()
        n = offset = 0
        while True:
            data = await loop.run_in_executor(None, self.objects.get_bytes, piece_name(self.video_id, self.fence, n))
            if data:
                n, offset = n + 1, offset + len(data)
                yield data
                continue
            state = await loop.run_in_executor(None, self.state)
            if state == "completed":          # the rest of the whole object, a chunk at a time
                body = await loop.run_in_executor(None, self.objects.open_from, f"videos/{self.video_id}.mp4", offset)
                if body is None:
                    return
                try:
                    while data := await loop.run_in_executor(None, body.read, CHUNK_BYTES):
                        yield data
                finally:
                    body.close()
                return
            if state != "running":
                return
            await asyncio.sleep(POLL_S)
