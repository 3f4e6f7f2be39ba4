"""Two real `longserve serve` replicas (tiny-latte, one worker each) on one PostgreSQL schema and one shared media
store (issue 34's acceptance): a bucket of an S3-compatible server (moto_server, tests/support/s3.py), or a shared
directory when that cannot start (a directory's files are tested at the store layer: test_store_contract.py). Jobs
created on one are claimed by both; every replica answers for every job; a SIGKILLed replica's job is finished by
the other (attempt 2, completed once); a DELETE on one stops the other's job within a step; a restart of both keeps
the completed videos and runs the queued ones; a model only one replica serves runs only there (an image-to-video
model, whose jobs' images go through the media store to the claim). Skipped, saying how
to run it, when no PostgreSQL answers ($LONGSERVE_TEST_POSTGRES). LONGSERVE_TEST_MEDIA_STORE=file runs them on a
shared directory instead of S3.

Cheap on purpose: the replicas start once per module (and once more for the restart), 32x32 videos of 4 frames and
2 steps; a replica's steps are slowed by sleeping (LONGSERVE_TEST_STEP_SLEEP_S, tests/support/faults) where a job
must stay running, so waiting burns no CPU."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import httpx
import psycopg
import pytest
from postgres import fresh_schema
from s3 import object_names, s3_server
from servers import ROOT, SERVE_KEY, faults_env, serve_command, wait_until_healthy

from longserve.server.api.app import free_port

AUTH = {"Authorization": f"Bearer {SERVE_KEY}"}
PNG_URL = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAACAAAAAgCAIAAAD8GO2jAAAAKklEQVR4nO3NMQEAAAjDMMC/" \
          "sMnCBHypgKaT1GfzegcAAAAAAAAAAACHLfgjAphuiURMAAAAAElFTkSuQmCC"      # a 32x32 grey PNG
LEASE_S = 5           # renewed every third: a replica starved by a loaded machine keeps its jobs
STEP_SLEEP_S = 0.25          # each replica's denoising steps: a running job stays running, cheaply


class Replica:
    def __init__(self, name, store_url, media, data_dir, *extra):
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = serve_command(self.port, data_dir, workers=1) + [
            "--store", store_url, "--media-store", media["url"], "--replica-id", name,
            "--lease-seconds", str(LEASE_S), "--max-attempts", "3", *extra]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=faults_env(LONGSERVE_TEST_STEP_SLEEP_S=str(STEP_SLEEP_S),
                                                                   OMP_NUM_THREADS="1", **media["env"]))
        self.http = httpx.Client(base_url=self.url, headers=AUTH, timeout=60)

    def ready(self):
        wait_until_healthy(self.proc, self.url, timeout_s=600)      # a loaded 2-core machine starts slowly
        return self

    def create(self, **body):
        body = {"prompt": "a red ball bouncing", "size": "32x32", "num_frames": 4, "num_inference_steps": 2,
                "seed": None, **body}
        body = {k: v for k, v in body.items() if v is not None}
        r = self.http.post("/v1/videos", json=body)
        assert r.status_code == 200, r.text
        return r.json()["id"]

    def health(self):
        return self.http.get("/health").json()

    def kill(self, sig=signal.SIGKILL):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)
        self.http.close()


def wait(replica, vid, until=("completed", "failed"), timeout=90):
    deadline = time.monotonic() + timeout
    while True:
        v = replica.http.get(f"/v1/videos/{vid}").json()
        if v.get("status") in until:
            return v
        assert time.monotonic() < deadline, f"{vid} is still {v}"
        time.sleep(0.1)


def settle(check, timeout=5):
    """`check()` turns true within `timeout` s (what publication removes goes just after the commit that completes
    the record)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not settled"
        time.sleep(0.05)


def lease(url, vid):
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT lease_owner, attempts, status FROM videos WHERE id = %s", (vid,)).fetchone()


def stored(media, vid, under="videos") -> list[str]:
    """The names of a video's files in the media store (objects or files), sorted; `under="inputs"`: its inputs'."""
    where = f"{under}/{vid}" + ("/" if under == "inputs" else "")
    if "s3" in media:
        return [name.rpartition("/")[2] for name in object_names(media["s3"], where)]
    return sorted(p.name for p in media["dir"].glob(f"{where}*"))


@contextlib.contextmanager
def media_store(root):
    """A bucket of moto_server, else (it cannot start, or LONGSERVE_TEST_MEDIA_STORE=file) a shared directory."""
    with contextlib.ExitStack() as stack:
        try:
            if os.environ.get("LONGSERVE_TEST_MEDIA_STORE") == "file":
                pytest.skip("LONGSERVE_TEST_MEDIA_STORE=file")
            server = stack.enter_context(s3_server())
        except pytest.skip.Exception as e:
            print(f"test_replicas: a shared directory, not S3: {e}")
            yield {"url": f"file://{root / 'media'}", "env": {}, "dir": root / "media"}
        else:
            yield {"url": server["url"], "env": server["env"], "s3": server}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    with fresh_schema("ls_replicas") as url, media_store(root) as media:
        a = Replica("A", url, media, root / "a")
        b = Replica("B", url, media, root / "b")
        state = {"url": url, "root": root, "media": media, "A": a.ready(), "B": b.ready()}
        try:
            yield state
        finally:
            for name in ("A", "B"):
                state[name].kill()


def test_jobs_created_on_one_replica_are_run_by_both_and_answered_the_same_on_both(cluster):
    a, b = cluster["A"], cluster["B"]
    ids = [a.create(seed=i) for i in range(20)]
    for vid in ids:
        v = wait(a, vid)
        assert v["status"] == "completed", v["error"]
    claimed = {r.name: r.health()["replica"]["claimed"] for r in (a, b)}
    # (a claim whose lease lapsed on a starved replica is claimed again: at least 20 claims)
    assert claimed["A"] > 0 and claimed["B"] > 0 and claimed["A"] + claimed["B"] >= 20, claimed
    metrics = a.http.get("/metrics").text             # labelled by replica
    assert f'longserve_replica_claimed_jobs{{replica="A"}} {claimed["A"]}' in metrics
    for vid in ids[:3]:
        assert a.http.get(f"/v1/videos/{vid}").json() == b.http.get(f"/v1/videos/{vid}").json()
        content = [r.http.get(f"/v1/videos/{vid}/content") for r in (a, b)]
        assert content[0].status_code == 200 and content[0].content == content[1].content
        assert content[0].content[4:8] == b"ftyp"
        events = [r.http.get(f"/v1/videos/{vid}/events").text for r in (a, b)]
        assert "video.completed" in events[0] and events[0] == events[1]
    listed = [r.http.get("/v1/videos", params={"limit": 100}).json()["data"] for r in (a, b)]
    assert listed[0] == listed[1] and {v["id"] for v in listed[0]} >= set(ids)
    models = a.http.get("/v1/models").json()["data"]
    assert [m["id"] for m in models if m["kind"] == "video"] == ["tiny-latte"]


def test_a_job_running_on_one_replica_is_followed_on_the_other_events_and_stream(cluster):
    import concurrent.futures

    a, b = cluster["A"], cluster["B"]
    vid = a.create(num_inference_steps=8, seed=3)      # 2 s of steps
    while (owner := lease(cluster["url"], vid))[2] != "in_progress":
        time.sleep(0.05)
    other = b if owner[0] == "A" else a

    def events():
        with other.http.stream("GET", f"/v1/videos/{vid}/events") as r:
            return [line[7:] for line in r.iter_lines() if line.startswith("event: ")]

    def stream():
        return other.http.get(f"/v1/videos/{vid}/content", params={"stream": "true"}).content

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        seen, streamed = pool.submit(events), pool.submit(stream)
        seen, streamed = seen.result(timeout=60), streamed.result(timeout=60)
    assert seen[0] in ("video.in_progress", "video.queued") and seen[-1] == "video.completed", seen
    final = other.http.get(f"/v1/videos/{vid}/content").content
    assert streamed == final and final[4:8] == b"ftyp"


def test_a_delete_on_one_replica_stops_the_job_running_on_the_other_within_a_step(cluster):
    a, b = cluster["A"], cluster["B"]
    vid = a.create(num_inference_steps=200)          # 200 steps of STEP_SLEEP_S: running for a minute
    while (owner := lease(cluster["url"], vid))[2] != "in_progress":
        time.sleep(0.05)
    runner, other = (a, b) if owner[0] == "A" else (b, a)
    assert runner.health()["replica"]["running"] == 1
    started = time.monotonic()
    assert other.http.delete(f"/v1/videos/{vid}").json()["deleted"] is True
    while runner.health()["replica"]["running"] != 0:
        assert time.monotonic() - started < 2 * STEP_SLEEP_S + 1.0, "the job still runs"
        time.sleep(0.02)
    assert runner.http.get(f"/v1/videos/{vid}").status_code == 404
    time.sleep(0.5)
    assert stored(cluster["media"], vid) == [], "its files were dropped"


def test_a_killed_replicas_job_is_finished_by_the_other_once_with_attempt_two(cluster):
    a, b = cluster["A"], cluster["B"]
    vid = a.create(num_inference_steps=12, seed=7)     # 3 s of steps
    while (owner := lease(cluster["url"], vid))[2] != "in_progress":
        time.sleep(0.05)
    victim, survivor = (a, b) if owner[0] == "A" else (b, a)
    time.sleep(2 * STEP_SLEEP_S)
    killed = time.monotonic()
    victim.kill()
    v = wait(survivor, vid, timeout=60)
    assert v["status"] == "completed", v
    assert time.monotonic() - killed < LEASE_S + 1.5 + 12 * STEP_SLEEP_S + 10
    assert lease(cluster["url"], vid) == (None, 2, "completed")
    content = survivor.http.get(f"/v1/videos/{vid}/content")
    assert content.status_code == 200 and content.content[4:8] == b"ftyp"
    settle(lambda: stored(cluster["media"], vid) == [f"{vid}.mp4", f"{vid}.png"])   # (S3: its pieces went)
    cluster["victim"] = victim.name


def test_a_restart_of_both_keeps_completed_videos_runs_queued_ones_and_a_model_only_b_serves_runs_on_b(cluster):
    url, root, media = cluster["url"], cluster["root"], cluster["media"]
    survivor = cluster["B"] if cluster.get("victim") == "A" else cluster["A"]
    done = survivor.create(seed=99)
    assert wait(survivor, done)["status"] == "completed"
    queued = [survivor.create(seed=100 + i, num_inference_steps=8) for i in range(3)]    # 2 s each
    while lease(url, queued[0])[2] != "in_progress":
        time.sleep(0.05)
    deadline = time.monotonic() + 10
    while lease(url, queued[1])[0] is None and time.monotonic() < deadline:   # the next is claimed a claim tick later
        time.sleep(0.05)
    assert [lease(url, v)[2] for v in queued[1:]] == ["queued", "queued"]
    assert lease(url, queued[1])[0] is not None and lease(url, queued[2])[0] is None    # claimed to run next; not
    for name in ("A", "B"):
        cluster[name].kill()
    a = Replica("A", url, media, root / "a")
    # B comes back serving an image-to-video model: its jobs carry an uploaded image, put in the media store and
    # read back by the claim (not held in the memory of the replica that took them)
    b = Replica("B", url, media, root / "b", "--model", "tiny-wan-i2v", "--served-model-name", "tiny-b")
    cluster["A"], cluster["B"] = a.ready(), b.ready()
    assert a.http.get(f"/v1/videos/{done}/content").status_code == 200
    only_b = [b.create(seed=200 + i, model="tiny-b", num_frames=1, input_reference={"image_url": PNG_URL})
              for i in range(3)]
    for vid in queued + only_b:
        v = wait(a, vid)
        assert v["status"] == "completed", v["error"]
    # the running one and the one claimed to run next were taken again when their leases lapsed; the third was
    # never claimed before the restart
    assert [lease(url, v)[1] for v in queued] == [2, 2, 1]
    # A serves tiny-latte only: it claimed the three queued before the restart, B (tiny-b) its own three, each
    # through the claim cycle with its image read back from the media store
    assert a.health()["replica"]["claimed"] == 3 and b.health()["replica"]["claimed"] == 3
    assert {a.http.get(f"/v1/videos/{v}").json()["model"] for v in only_b} == {"tiny-b"}
    assert [stored(media, v) for v in only_b] == [[f"{v}.mp4", f"{v}.png"] for v in only_b]
    settle(lambda: not any(stored(media, v, "inputs") for v in only_b))     # their inputs went with publication
    assert sorted(m["id"] for m in a.http.get("/v1/models").json()["data"] if m["kind"] == "video") == \
        ["tiny-b", "tiny-latte"]
    r = a.http.post("/v1/videos", json={"prompt": "x", "model": "tiny-b"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model" and "B" in r.json()["error"]["message"]
    r = a.http.post("/v1/videos", json={"prompt": "x", "model": "nobody-serves-this"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
