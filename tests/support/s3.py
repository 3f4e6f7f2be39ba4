"""An S3-compatible server for a test module: moto's `moto_server` (the test extra, `moto[server]`) on a free port,
with a fresh bucket. Tests that need it skip, saying how to run them, when it cannot start."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import uuid

HOW_TO = "no S3-compatible server could be started ({why}); install the test extra (pip install -e '.[test]')"


@contextlib.contextmanager
def s3_server(prefix: str = "longserve"):
    """Yields {"env": the AWS_* variables a client of it needs, "url": s3://<bucket>/<prefix>, "bucket", "client"}
    (boto3's client of the bucket); the server is stopped on exit. pytest.skip when it cannot start."""
    import pytest

    from longserve.server.api.app import free_port

    exe = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or shutil.which("moto_server")
    try:
        import boto3
    except ImportError:
        boto3 = None
    if exe is None or boto3 is None:
        pytest.skip(HOW_TO.format(why="moto_server or boto3 is not installed"))
    port = free_port()
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    env = {"AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1"}
    bucket = f"ls-{uuid.uuid4().hex[:12]}"
    try:
        client = boto3.session.Session().client("s3", endpoint_url=env["AWS_ENDPOINT_URL_S3"],
                                                aws_access_key_id="test", aws_secret_access_key="test",
                                                region_name="us-east-1")
        deadline = time.monotonic() + 30
        while True:
            try:
                client.create_bucket(Bucket=bucket)
                break
            except Exception as e:  # noqa: BLE001 - not listening yet
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.skip(HOW_TO.format(why=f"moto_server did not answer: {e}"))
                time.sleep(0.2)
        yield {"env": env, "url": f"s3://{bucket}/{prefix}", "bucket": bucket, "prefix": prefix, "client": client}
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def object_names(server, under: str = "") -> list[str]:
    """The names in the bucket under the prefix (relative to it: videos/<id>.mp4), sorted."""
    head = f"{server['prefix']}/"
    pages = server["client"].get_paginator("list_objects_v2").paginate(Bucket=server["bucket"], Prefix=head + under)
    return sorted(o["Key"][len(head):] for page in pages for o in page.get("Contents", ()))
