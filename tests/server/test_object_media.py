"""`--media-store s3://` at the store layer: two replicas' stores (two data dirs) on one PostgreSQL schema and one
bucket of an S3-compatible server the module starts (moto_server, tests/support/s3.py). A claim publishes whole
objects only while its fence holds; any replica reads them; a running claim's pieces stream on another replica and
end with the whole object; reuse copies, deletion removes the objects. The two real replicas of test_replicas.py run
on such a bucket too (end to end). Skipped, saying how, when no PostgreSQL answers or moto_server cannot start."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
from postgres import fresh_schema
from s3 import object_names, s3_server

from longserve.server.api.store import VideoRecord


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server, pytest.MonkeyPatch.context() as mp:
        for name, value in server["env"].items():
            mp.setenv(name, value)
        yield server


@pytest.fixture(scope="module")
def pair(s3, tmp_path_factory):
    """Replicas A and B's stores: one schema, one bucket, a data dir each."""
    from longserve.server.api.media_store import open_objects
    from longserve.server.api.pg_store import PostgresJobStore

    root = tmp_path_factory.mktemp("objects")
    with fresh_schema("ls_objects") as url:
        a = PostgresJobStore(url, root / "a", objects=open_objects(s3["url"]))
        b = PostgresJobStore(url, root / "b", objects=open_objects(s3["url"]))
        try:
            yield a, b
        finally:
            a.close()
            b.close()


def record(video_id) -> VideoRecord:
    return VideoRecord(id=video_id, created_at=1, status="queued", model="tiny-latte", prompt="p", seconds="1",
                       size="32x32", params={"seed": 1})


def lapse(store, video_id):
    with store.pool.connection() as conn:
        conn.execute("UPDATE videos SET lease_until = now() - interval '1 second' WHERE id = %s", (video_id,))


def test_a_claim_publishes_whole_objects_only_while_its_fence_holds_and_every_replica_reads_them(pair, s3):
    a, b = pair
    a.insert(record("video_o1"))
    (_, fence_a, _, _), = a.claim("A", ["tiny-latte"], 1, lease_s=30, idle=True)
    a.objects.put_bytes(f"videos/video_o1.f{fence_a}.part/00000000", b"piece")      # what A streamed so far
    lapse(a, "video_o1")
    b.requeue_lapsed(max_attempts=3)
    assert object_names(s3, "videos/video_o1") == [], "the lapsed claim's pieces were dropped"
    (_, fence_b, _, _), = b.claim("B", ["tiny-latte"], 1, lease_s=30, idle=True)
    for path in (a.video_path("video_o1", fence_a), a.thumbnail_path("video_o1", fence_a)):
        path.write_bytes(b"late")                     # A, not knowing, finishes anyway
    assert a.publish("video_o1", fence_a, status="completed") is False
    assert object_names(s3, "videos/video_o1") == [] and a.content_file("video_o1") is None
    b.video_path("video_o1", fence_b).write_bytes(b"bee")
    b.thumbnail_path("video_o1", fence_b).write_bytes(b"png")
    assert b.publish("video_o1", fence_b, status="completed", progress=100, bytes=6) is True
    assert object_names(s3, "videos/video_o1") == ["videos/video_o1.mp4", "videos/video_o1.png"]
    assert a.content_file("video_o1").read_bytes() == b"bee"           # fetched into A's cache
    assert a.content_file("video_o1", "thumbnail").read_bytes() == b"png"
    b.link_files("video_o1", "video_o2")                               # reuse: a server-side copy
    assert b.objects.get_bytes("videos/video_o2.mp4") == b"bee"
    a.remove_files("video_o1")                                         # a DELETE, or expiry, on any replica
    assert object_names(s3, "videos/video_o1") == [] and a.content_file("video_o1") is None
    with pytest.raises(FileNotFoundError):
        b.link_files("video_o1", "video_o3")
    assert object_names(s3, "videos/video_o3") == []


def test_a_running_claims_pieces_stream_on_another_replica_and_end_with_the_whole_object(pair, s3):
    from longserve.server.api.object_media import ObjectTail

    a, b = pair
    a.insert(record("video_s1"))
    (_, fence, _, _), = a.claim("A", ["tiny-latte"], 1, lease_s=30, idle=True)
    part = a.partial_path("video_s1", fence)
    writer = SimpleNamespace(part_path=part, done=threading.Event())
    f = open(part, "wb")
    a.writing("video_s1", fence, writer)
    status = {"s": "running"}
    tail = ObjectTail(b.objects, "video_s1", fence, lambda: status["s"])
    got = []

    def read():
        async def run():
            async for data in tail.stream():
                got.append(data)
        asyncio.run(run())

    reader = threading.Thread(target=read)
    reader.start()
    sent = b""
    for chunk in (b"ftyp-one", b"-two", b"-three"):       # appended while B reads: B has each before the next
        f.write(chunk)
        f.flush()
        sent += chunk
        deadline = time.monotonic() + 10
        while b"".join(got) != sent:
            assert time.monotonic() < deadline, got
            time.sleep(0.02)
    f.write(b"-tail")                                      # not yet put as a piece when the writer ends
    f.close()
    writer.done.set()
    part.rename(a.video_path("video_s1", fence))
    a.thumbnail_path("video_s1", fence).write_bytes(b"png")
    assert a.publish("video_s1", fence, status="completed", progress=100) is True
    status["s"] = "completed"
    reader.join(10)
    assert b"".join(got) == b"ftyp-one-two-three-tail" and len(got) >= 3
    assert object_names(s3, "videos/video_s1") == ["videos/video_s1.mp4", "videos/video_s1.png"]


def test_an_object_store_is_checked_before_anything_starts(s3):
    from longserve.server.api.config import ServeConfig
    from longserve.server.api.media_store import open_objects

    for bad, needs in (("s3://", "s3://bucket"), ("s3://b/p?x=1", "s3://bucket"), ("gs://b", "scheme")):
        with pytest.raises(ValueError, match="media_store") as e:
            ServeConfig.from_options(model="tiny-latte", media_store=bad, store="postgresql://h/db")
        assert needs in str(e.value)
    with pytest.raises(ValueError, match="media_store.*postgresql"):
        ServeConfig.from_options(model="tiny-latte", media_store=s3["url"])         # SQLite: one server
    with pytest.raises(ValueError, match="media_store.*cannot be reached"):
        open_objects("s3://no-such-bucket-here/p")


def test_a_jobs_uploaded_inputs_are_read_back_by_the_replica_that_claims_it(pair, s3, tmp_path):
    from longserve.engine.images import EncodedImage
    from longserve.pipelines.media import EncodedVideo
    from longserve.server.api.job_inputs import pack_inputs, read_inputs
    from longserve.server.api.store import SqliteJobStore

    a, b = pair
    image, video = EncodedImage(b"png-bytes", 3, 2, "d1"), EncodedVideo(b"mp4-bytes", 4, 32, 32, "d2", 1024)
    rec = record("video_i1")
    rec.params["options"] = {"image": "3x2", "video": "4 frames 32x32"}      # what the record keeps
    a.put_inputs(rec.id, pack_inputs({"image": image, "video": video, "other": 1}))
    got = read_inputs(b, rec)                                              # on the claiming replica
    assert set(got) == {"image", "video"}
    assert (got["image"].data, got["image"].shape, got["image"].digest) == (b"png-bytes", (2, 3, 3), "d1")
    assert (got["video"].data, got["video"].shape, got["video"].max_pixels) == (b"mp4-bytes", (4, 32, 32, 3), 1024)
    assert read_inputs(b, record("video_plain")) == {}
    b.remove_files(rec.id)                                                 # a DELETE or expiry: they go
    assert object_names(s3, f"inputs/{rec.id}") == [] and read_inputs(a, rec) is None
    local = SqliteJobStore(tmp_path / "one")                                     # no shared media: none to read
    assert read_inputs(local, rec) is None
    local.close()

