"""Storage faults, retention, the quota and durability (issue 20).

The MP4 writer on its own: a write that fails with ENOSPC while ffmpeg has more output than a pipe holds
fails the writer (storage_full) instead of hanging it; a `close` that raises still ends it; a stalled encoder
never holds its caller past the hand-off's timeout; the file and its directory are fsynced before it is
complete. Then one in-process server (tiny-latte, 1 worker) shared by the tests that follow: a disk that
fills while a video encodes (the fault injected at the write calls, so it runs anywhere) fails that job with
storage_full within 30 s, /health says degraded, creates get 507, and once space is back the next video
completes with no restart; expired videos keep their object and lose their content; the quota evicts the
oldest first; a drain fails what outlives it. Last, where the machine lets a test mount one, the same on a
real 4 MiB tmpfs filled while a video denoises (its own server; skipped elsewhere).
"""

import asyncio
import builtins
import errno
import os
import sqlite3
import stat
import threading
import time

import numpy as np
import pytest
from servers import serving, sse_events

import longserve.server.api.store as store_module
import longserve.server.api.stored_files as stored_files
import longserve.server.media as media
from longserve.server.api.metrics import parse_text
from longserve.server.api.store import SqliteJobStore
from longserve.server.media import FragmentedMP4Writer

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class _FileOnDisk:
    """A file object whose writes (and optionally its close) hit the test's full disk."""

    def __init__(self, f, disk):
        self._f, self._disk = f, disk

    def write(self, data):
        if self._disk.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = self._f.write(data)
        self._disk.writes += 1
        if self._disk.full_after_writes is not None and self._disk.writes >= self._disk.full_after_writes:
            self._disk.full = True
        return n

    def close(self):
        self._f.close()
        if self._disk.close_fails:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._f, name)


class FakeDisk:
    """The data dir's file system as the server sees it: the MP4 writer's files (`server.media.open`), the job
    store's writes and the free space it reports. `full` makes them fail with ENOSPC ("database or disk is
    full" for SQLite) and the free space read 0; `fill_when_encoding` fills it as a video's part file opens."""

    def __init__(self, monkeypatch):
        self.full = False
        self.fill_when_encoding = False
        self.full_after_writes = None
        self.close_fails = False
        self.writes = 0
        real_open = builtins.open

        def fake_open(path, mode="r", *args, **kwargs):
            f = real_open(path, mode, *args, **kwargs)
            if "w" in mode and str(path).endswith((".mp4.part", ".mp4")):
                if self.fill_when_encoding:
                    self.full = True
                return _FileOnDisk(f, self)
            return f

        monkeypatch.setattr(media, "open", fake_open, raising=False)
        monkeypatch.setattr(stored_files, "disk_free_bytes", lambda path: 0 if self.full else 1 << 40, raising=False)
        for name in ("insert", "update"):
            real = getattr(SqliteJobStore, name)

            def guarded(store, *args, _real=real, **kwargs):
                if self.full:
                    raise sqlite3.OperationalError("database or disk is full")
                return _real(store, *args, **kwargs)

            monkeypatch.setattr(SqliteJobStore, name, guarded)


def noise(n, size, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)   # (n, H, W, 3)


def finished(writer):
    """finish(); (ok, error) from the callback, or None if it did not run within 10 s."""
    got, called = [], threading.Event()
    writer.finish(lambda ok, err: (got.append((ok, err)), called.set()))
    return got[0] if called.wait(10) else None


# -- the writer ------------------------------------------------------------------------------------------------


def test_a_full_disk_fails_the_writer_with_storage_full_even_when_ffmpeg_has_more_than_a_pipe_of_output(
        tmp_path, monkeypatch):
    disk = FakeDisk(monkeypatch)
    disk.full_after_writes = 1                         # the header goes in, then the disk is full
    writer = FragmentedMP4Writer(tmp_path / "v.mp4.part", tmp_path / "v.mp4", 256, 256, 8, keyframe_interval=1)
    result = []

    def produce():            # noise does not compress: far more than the 64 KiB a pipe holds
        for i in range(8):
            writer.write(noise(4, 256, seed=i))
        result.append(finished(writer))

    producer = threading.Thread(target=produce, daemon=True)
    t0 = time.monotonic()
    producer.start()
    producer.join(20)
    try:
        assert not producer.is_alive(), "the producer hung on the encoder after the write error"
        assert result == [(False, writer.error)] and writer.error_code == "storage_full", (result, writer.error)
        assert "No space left" in writer.error and time.monotonic() - t0 < 20
        assert writer.done.is_set() and writer._proc.poll() is not None, "ffmpeg was stopped"
    finally:
        writer._proc.kill()


def test_the_done_callback_runs_when_closing_the_file_fails(tmp_path, monkeypatch):
    disk = FakeDisk(monkeypatch)
    disk.close_fails = True                            # buffered bytes flushed on close onto a full disk
    writer = FragmentedMP4Writer(tmp_path / "v.mp4.part", tmp_path / "v.mp4", 32, 32, 8)
    writer.write(noise(4, 32))
    try:
        assert finished(writer) == (False, writer.error), "the callback never ran"
        assert writer.error_code == "storage_full" and writer.done.is_set() and not writer.ok
    finally:
        writer._proc.kill()


def test_the_mp4_and_its_directory_are_fsynced_before_the_writer_reports_it_complete(tmp_path, monkeypatch):
    synced, real_fsync = [], os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    writer = FragmentedMP4Writer(tmp_path / "v.mp4.part", tmp_path / "v.mp4", 32, 32, 8)
    writer.write(noise(4, 32))
    ok = finished(writer)
    at_callback = list(synced)
    assert ok == (True, None)
    part, directory = str(tmp_path / "v.mp4.part"), str(tmp_path)
    assert part in at_callback and directory in at_callback, at_callback
    assert at_callback.index(part) < at_callback.index(directory), "the data first, then the rename"
    assert (tmp_path / "v.mp4").read_bytes()[4:8] == b"ftyp"


def test_a_stalled_encoder_holds_its_producer_no_longer_than_the_hand_off_timeout(tmp_path):
    """write_async waits for room in this writer's own hand-off, on the event loop, never in a thread: while
    ffmpeg is stopped, other coroutines keep running, and after the timeout the writer fails."""
    import signal

    writer = FragmentedMP4Writer(tmp_path / "v.mp4.part", tmp_path / "v.mp4", 256, 256, 8, stall_timeout_s=1.0)
    os.kill(writer._proc.pid, signal.SIGSTOP)

    async def main():
        ticks = 0

        async def heartbeat():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.02)
                ticks += 1

        beat = asyncio.create_task(heartbeat())
        t0 = time.monotonic()
        for i in range(40):                     # far more than the pipe and the hand-off hold
            await writer.write_async(noise(4, 256, seed=i))
            if writer.failed:
                break
        beat.cancel()
        return time.monotonic() - t0, ticks

    try:
        elapsed, ticks = asyncio.run(main())
        assert writer.error_code == "encoding_failed" and "took no frames" in writer.error
        assert elapsed < 5 and ticks >= 0.5 * elapsed / 0.02, (elapsed, ticks)
        assert writer.done.wait(10), "a killed encoder ends its writer"
    finally:
        if writer._proc.poll() is None:
            os.kill(writer._proc.pid, signal.SIGCONT)
            writer._proc.kill()


def test_the_data_dir_is_private_to_the_server_user(tmp_path):
    store = SqliteJobStore(tmp_path / "new" / "data")
    try:
        store.insert(store_module.VideoRecord(id="video_x", created_at=1, status="queued", model="m", prompt="p",
                                              seconds="1", size="32x32", params={}))
        mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
        assert mode(tmp_path / "new" / "data") == 0o700 and mode(store.video_dir) == 0o700
        for path in (store.db_path, store.db_path.with_name("longserve.db-wal")):
            assert mode(path) == 0o600, path
    finally:
        store.close()


# -- one server ---------------------------------------------------------------------------------------------------

RETENTION_S = 60


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("storage") / "data", model="tiny-latte", workers=1, default_steps=2,
                 decode_chunk_frames=4, retention_s=RETENTION_S, min_free_bytes=1 << 20) as s:
        yield s


@pytest.fixture
def http(server, http_client):
    return http_client(server["url"])


def create(http, **body):
    body = {"prompt": "a red ball bouncing", "size": "32x32", "num_frames": 8, "num_inference_steps": 2,
            "seed": 0, **body}
    r = http.post("/v1/videos", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def wait(http, vid, timeout=60):
    deadline = time.monotonic() + timeout
    while (v := http.get(f"/v1/videos/{vid}").json())["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, f"{vid} is still {v['status']} after {timeout} s"
        time.sleep(0.05)
    return v


def test_a_disk_that_fills_while_a_video_encodes_fails_it_refuses_creates_and_recovers_without_restart(
        server, http, monkeypatch):
    service = server["service"]
    disk = FakeDisk(monkeypatch)
    disk.fill_when_encoding = True                     # the thumbnail is written; the MP4 finds the disk full
    video = create(http)
    t0 = time.monotonic()
    v = wait(http, video["id"], timeout=30)
    assert v["status"] == "failed" and v["error"]["code"] == "storage_full", v
    assert time.monotonic() - t0 < 30
    assert service.store.get(video["id"]).status == "in_progress", "SQLite could not take the failure yet"
    assert not list(server["data_dir"].glob(f"videos/{video['id']}*")), "what was written is removed"

    health = http.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "degraded", health.json()
    assert "--min-free-bytes" in health.json()["reason"] and "No space left" in health.json()["reason"]
    refused = http.post("/v1/videos", json={"prompt": "another", "size": "32x32", "num_frames": 4})
    assert refused.status_code == 507 and refused.headers["Retry-After"], refused.text
    assert refused.json()["error"]["code"] == "storage_full"
    with monkeypatch.context() as m:           # free space that looks fine (a quota): SQLite refuses the insert
        m.setattr(stored_files, "disk_free_bytes", lambda path: 1 << 40)
        refused = http.post("/v1/videos", json={"prompt": "another", "size": "32x32", "num_frames": 4})
    assert refused.status_code == 507 and refused.json()["error"]["code"] == "storage_full", refused.text
    assert http.get("/v1/models").status_code == 200, "the server keeps serving"
    assert http.get(f"/v1/videos/{video['id']}").json()["status"] == "failed", "still served from memory"

    disk.full = disk.fill_when_encoding = False        # space is freed
    again = wait(http, create(http, seed=1)["id"])
    assert again["status"] == "completed", again
    deadline = time.monotonic() + 10
    while service.store.get(video["id"]).status != "failed" or http.get("/health").status_code != 200:
        assert time.monotonic() < deadline, (service.store.get(video["id"]), http.get("/health").json()["reason"])
        time.sleep(0.1)
    assert service.store.get(video["id"]).error["code"] == "storage_full"
    assert http.get(f"/v1/videos/{again['id']}/content").content[4:8] == b"ftyp"


def test_an_expired_video_keeps_its_object_and_its_content_is_gone(server, http):
    service = server["service"]
    v = wait(http, create(http, seed=2)["id"])
    assert v["expires_at"] == v["completed_at"] + RETENTION_S
    files = list(server["data_dir"].glob(f"videos/{v['id']}*"))
    assert len(files) == 2, "the MP4 and its thumbnail"
    expired_before = parse_text(http.get("/metrics").text).get("longserve_jobs_expired_total", 0)
    expired = service.expire(now=v["expires_at"] - 1)       # what earlier tests finished
    assert v["id"] not in expired
    expired += service.expire(now=v["expires_at"])
    assert v["id"] in expired
    assert not any(f.exists() for f in files)

    again = http.get(f"/v1/videos/{v['id']}")
    assert again.status_code == 200 and again.json()["status"] == "completed"
    assert again.json()["expires_at"] == v["expires_at"]
    for variant in ("video", "thumbnail"):
        gone = http.get(f"/v1/videos/{v['id']}/content", params={"variant": variant})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "video_expired", gone.text
    assert v["id"] in [x["id"] for x in http.get("/v1/videos").json()["data"]]
    assert parse_text(http.get("/metrics").text).get("longserve_jobs_expired_total", 0) == expired_before + len(expired)
    assert v["id"] not in service.expire(now=v["expires_at"] + 10), "expired once"


def test_the_storage_quota_evicts_the_oldest_completed_videos_first_and_never_a_running_one(
        server, http, monkeypatch):
    service = server["service"]
    service.expire(now=int(time.time()) + 10 * RETENTION_S)      # what earlier tests left: out of the way
    same = {"prompt": "a blue ball bouncing", "num_frames": 4}    # (a repeat with one seed would be one copy)
    first, second = [wait(http, create(http, **same, seed=seed)["id"]) for seed in (7, 9)]
    sizes = {k.id: k.bytes for k in service.store.stored()}
    assert list(sizes) == [first["id"], second["id"]] and min(sizes.values()) > 0
    running = create(http, num_inference_steps=200, num_frames=4, seed=8)
    # room for two videos of about this size, not three
    monkeypatch.setattr(service.storage.quotas, "per_owner", int(2.5 * max(sizes.values())))
    third = wait(http, create(http, **same, seed=11)["id"])      # over the quota once it completes
    assert third["status"] == "completed"

    old = http.get(f"/v1/videos/{first['id']}/content")
    assert old.status_code == 404 and old.json()["error"]["code"] == "video_expired"
    evicted = http.get(f"/v1/videos/{first['id']}").json()
    assert evicted["status"] == "completed" and evicted["expires_at"] <= int(time.time())
    for kept in (second, third):
        assert http.get(f"/v1/videos/{kept['id']}/content").content[4:8] == b"ftyp"
    assert http.get(f"/v1/videos/{running['id']}").json()["status"] in ("queued", "in_progress")
    assert sum(k.bytes for k in service.store.stored()) <= service.storage.quotas.per_owner
    assert http.delete(f"/v1/videos/{running['id']}").status_code == 200


def test_a_drain_fails_what_runs_past_its_time_with_server_shutdown_and_refuses_creates(server, http):
    """`VideoService.drain` (what SIGTERM runs; tests/server/test_drain.py sends a real one): a video still
    running when the drain's time is up fails with server_shutdown, and its event stream ends with it."""
    service = server["service"]
    long = create(http, num_inference_steps=200, num_frames=4, seed=9)["id"]
    while http.get(f"/v1/videos/{long}").json()["status"] != "in_progress":
        time.sleep(0.02)
    events = []
    reader = threading.Thread(target=collect_events, args=(server["url"], long, events), daemon=True)
    reader.start()
    while not events:
        time.sleep(0.02)
    drain = threading.Thread(target=service.drain, args=(0.5,), daemon=True)
    try:
        drain.start()
        while (r := http.post("/v1/videos", json={"prompt": "x"})).status_code != 503:
            time.sleep(0.02)
        assert r.json()["error"]["code"] == "server_shutdown"
        drain.join(15)
        reader.join(10)
        v = http.get(f"/v1/videos/{long}").json()
        assert v["status"] == "failed" and v["error"]["code"] == "server_shutdown", v
        assert events[-1][0] == "video.failed" and events[-1][1]["error"]["code"] == "server_shutdown"
        assert service.store.get(long).status == "failed"
    finally:
        service.shutdown.draining = service.shutdown.drained = False


def collect_events(url, vid, out):
    import httpx

    with httpx.Client(base_url=url, timeout=60) as c, c.stream("GET", f"/v1/videos/{vid}/events") as r:
        out.extend(sse_events(r))


@pytest.fixture
def small_file_system(tmp_path):
    """A 4 MiB tmpfs (where this machine lets the test mount one; the tests above inject the same faults)."""
    import shutil
    import subprocess

    where = tmp_path / "tmpfs"
    where.mkdir()
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)],
                                                       capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(directory):
    """Write a file until the file system is full; returns it."""
    filler = directory / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (64 << 10))
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return filler


def test_on_a_real_small_file_system_a_full_disk_fails_the_job_and_freeing_it_is_enough(small_file_system,
                                                                                          http_client):
    with serving(small_file_system / "data", model="tiny-latte", workers=1, default_steps=2,
                 decode_chunk_frames=4, min_free_bytes=512 << 10) as s:
        http = http_client(s["url"])
        video = create(http, num_inference_steps=6)
        filler = fill(small_file_system)                        # while it denoises (4 MiB: a few ms)
        v = wait(http, video["id"], timeout=30)
        assert v["status"] == "failed" and v["error"]["code"] == "storage_full", v
        assert http.get("/health").json()["status"] == "degraded"
        refused = http.post("/v1/videos", json={"prompt": "another", "size": "32x32", "num_frames": 4})
        assert refused.status_code == 507 and refused.json()["error"]["code"] == "storage_full", refused.text
        filler.unlink()
        again = wait(http, create(http, seed=1)["id"])
        assert again["status"] == "completed", again
        assert http.get(f"/v1/videos/{again['id']}/content").content[4:8] == b"ftyp"
