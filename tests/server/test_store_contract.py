"""The job store's contract, one set of tests over both stores: the SQLite file (one server) and PostgreSQL (the
replicas' shared store, on a fresh schema of the server at $LONGSERVE_TEST_POSTGRES; skipped with how to run it when
none answers). What the service relies on: rows round-trip, pages, owners, reuse lookups, retention and quota
queries; PostgreSQL's migrations apply once and are recorded."""

from __future__ import annotations

import time

import pytest
from postgres import fresh_schema

from longserve.server.api.store import COLUMN_TYPES, VIDEO_TABLE, JobStore, SqliteJobStore, VideoRecord


@pytest.fixture(scope="module")
def pg_url():
    with fresh_schema() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    if request.param == "sqlite":
        s = SqliteJobStore(tmp_path / "data")
    else:
        from longserve.server.api.pg_store import PostgresJobStore

        s = PostgresJobStore(request.getfixturevalue("pg_url"), tmp_path / "data")
        with s.pool.connection() as conn:
            conn.execute("TRUNCATE videos RESTART IDENTITY")   # each test starts from an empty table
    yield s
    s.close()


def record(video_id, owner=None, status="queued", key=None, created_at=1, **params) -> VideoRecord:
    return VideoRecord(id=video_id, created_at=created_at, status=status, model="tiny-latte",
                       prompt="a red ball \u00e9\u6f22", seconds="1", size="32x32",
                       params={"seed": 1, "negative_prompt": "", **params}, request_key=key, owner=owner)


def test_a_record_round_trips_with_its_json_and_text(store):
    rec = record("video_a", owner="key-a", nested={"x": [1, 2.5, None]})
    seq = store.insert(rec)
    assert rec.seq == seq and seq >= 1
    got = store.get("video_a")
    assert got == rec
    store.update("video_a", status="failed", error={"code": "c", "message": "m"}, progress=7,
                 params={**rec.params, "transformer_blocks": {"evaluated": 3}})
    got = store.get("video_a")
    assert (got.status, got.error, got.progress, got.params["transformer_blocks"]) == \
        ("failed", {"code": "c", "message": "m"}, 7, {"evaluated": 3})
    assert store.get("video_missing") is None
    assert store.delete("video_a") is True and store.delete("video_a") is False and store.get("video_a") is None


def test_text_that_does_not_encode_is_never_stored(store):
    with pytest.raises(ValueError, match="prompt"):
        store.insert(VideoRecord(id="video_bad", created_at=1, status="queued", model="m", prompt="a\ud800",
                                 seconds="1", size="32x32", params={}))
    assert store.get("video_bad") is None


def test_pages_follow_creation_order_and_owners(store):
    for i in range(5):
        store.insert(record(f"video_{i}", owner="key-a" if i % 2 == 0 else "key-b"))
    recs, more = store.page(None, 2, "asc")
    assert [r.id for r in recs] == ["video_0", "video_1"] and more
    recs, more = store.page(recs[-1].seq, 10, "asc")
    assert [r.id for r in recs] == ["video_2", "video_3", "video_4"] and not more
    recs, more = store.page(None, 10, "desc", owner="key-a")
    assert [r.id for r in recs] == ["video_4", "video_2", "video_0"] and not more
    assert store.page(None, 10, "desc", owner="key-c") == ([], False)
    assert store.counts_by_status() == {"queued": 5}
    assert [r.id for r in store.by_status("queued")] == [f"video_{i}" for i in range(5)]


def test_reuse_finds_the_newest_completed_video_of_the_same_owner_only(store):
    store.insert(record("video_old", owner=None, status="completed", key="k"))
    store.insert(record("video_new", owner=None, status="completed", key="k"))
    store.insert(record("video_other", owner="key-a", status="completed", key="k"))
    store.insert(record("video_queued", owner=None, status="queued", key="k"))
    assert store.completed_with_key("k", None).id == "video_new"
    assert store.completed_with_key("k", "key-a").id == "video_other"
    assert store.completed_with_key("k", "key-b") is None
    store.update("video_new", expired=True)
    assert store.completed_with_key("k", None).id == "video_old"


def test_retention_and_quota_queries(store):
    store.insert(record("video_a", status="completed"))
    store.insert(record("video_b", status="completed"))
    store.insert(record("video_c", status="failed"))
    assert sorted(store.unmeasured()) == ["video_a", "video_b"]
    store.update("video_a", completed_at=20, bytes=100, expires_at=50)
    store.update("video_b", completed_at=10, bytes=None, expires_at=None)
    store.update("video_c", completed_at=5, expires_at=40)
    assert store.stored() == [("video_b", None, "video_b", 0, None), ("video_a", None, "video_a", 100, 50)]
    # (oldest completed first)
    assert store.expired(now=45) == ["video_c"] and store.expired(now=50) == ["video_a", "video_c"]
    store.update("video_c", expired=True)
    assert store.expired(now=50) == ["video_a"] and store.get("video_c").expired is True


def test_quota_queries_are_per_owner_count_shared_copies_by_their_content_and_active_uploads(store):
    store.insert(record("video_a", owner="k", status="completed"))
    reuse = record("video_b", owner="k", status="completed")
    reuse.content = "video_a"                          # a reuse: hard links to video_a's files
    store.insert(reuse)
    store.insert(record("video_c", owner="other", status="completed"))
    up = record("video_d", owner="k")
    up.input_bytes = 1000                              # a queued job's uploads in the media store
    store.insert(up)
    for i, vid in enumerate(("video_a", "video_b", "video_c")):
        store.update(vid, completed_at=10 + i, bytes=100)
    assert store.stored("k") == [("video_a", "k", "video_a", 100, None), ("video_b", "k", "video_a", 100, None)]
    assert [k.id for k in store.stored("other")] == ["video_c"] and store.stored(None) == []
    assert store.active_inputs("k") == 1000 and store.active_inputs("other") == 0 and store.active_inputs() == 1000
    store.update("video_d", status="failed")
    assert store.active_inputs("k") == 0
    assert store.get("video_b").content == "video_a" and store.get("video_d").input_bytes == 1000


def test_files_live_in_the_media_directory_and_are_linked_for_reuse(store):
    store.video_path("video_a").write_bytes(b"mp4")
    store.thumbnail_path("video_a").write_bytes(b"png")
    assert store.link_files("video_a", "video_b") is True          # hard links: one copy on disk
    assert store.files_bytes("video_b") == 6 and store.video_path("video_b").read_bytes() == b"mp4"
    store.remove_files("video_a")
    assert store.files_bytes("video_a") == 0 and store.files_bytes("video_b") == 6
    with pytest.raises(FileNotFoundError):
        store.link_files("video_a", "video_c")


def test_postgresql_migrations_apply_once_and_are_recorded(pg_url, tmp_path):
    from longserve.server.api.pg_store import MIGRATIONS, PostgresJobStore

    first = PostgresJobStore(pg_url, tmp_path / "a")
    second = PostgresJobStore(pg_url, tmp_path / "b")        # another replica on the same schema
    try:
        assert second.migrated == [] and second.schema_version() == MIGRATIONS[-1][0]
        first.insert(record("video_shared"))
        assert second.get("video_shared").prompt == "a red ball \u00e9\u6f22"
    finally:
        first.close()
        second.close()


@pytest.fixture
def pg(pg_url, tmp_path):
    from longserve.server.api.pg_store import PostgresJobStore

    s = PostgresJobStore(pg_url, tmp_path / "data")
    with s.pool.connection() as conn:
        conn.execute("TRUNCATE videos RESTART IDENTITY")
    yield s
    s.close()


def lapse(store, video_id):
    with store.pool.connection() as conn:                 # as if its replica stopped renewing long ago
        conn.execute("UPDATE videos SET lease_until = now() - interval '1 second' WHERE id = %s", (video_id,))


def test_replicas_claim_by_model_and_work_budget_and_never_the_same_job(pg):
    import concurrent.futures

    for i in range(3):
        pg.insert(record(f"video_{i}"))
    pg.insert(VideoRecord(id="video_other", created_at=1, status="queued", model="other", prompt="p",
                          seconds="1", size="32x32", params={}))
    pg.set_cost("video_1", 2.0)
    claimed = pg.claim("A", ["tiny-latte"], budget=1.5, lease_s=30, idle=False)
    assert [(r.id, fence, attempts) for r, fence, attempts, _ in claimed] == [("video_0", 1, 1)]
    assert pg.claim("A", ["absent"], budget=9, lease_s=30, idle=True) == []
    # idle: the next job is claimed even past the budget (a job within the limits always runs)
    assert [c[0].id for c in pg.claim("B", ["tiny-latte"], budget=0.5, lease_s=30, idle=True)] == ["video_1"]
    for i in range(3, 23):
        pg.insert(record(f"video_{i}"))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(lambda n: [c[0].id for c in pg.claim(f"R{n}", ["tiny-latte"], 3, 30, False)], range(8)))
    ids = [i for run in runs for i in run]
    assert len(ids) == len(set(ids)) and "video_0" not in ids and "video_1" not in ids
    assert pg.lease_of("video_other") == (None, 0, 0)


def test_a_lapsed_lease_requeues_with_an_attempt_and_fences_off_the_old_owner(pg):
    from longserve.server.api.pg_store import LeaseLost

    pg.insert(record("video_a"))
    (rec, fence_a, attempts, _), = pg.claim("A", ["tiny-latte"], 1, lease_s=30, idle=True)
    pg.update("video_a", fence=fence_a, status="in_progress")
    assert pg.renew("A", {"video_a": fence_a}, 30) == {"video_a"}
    assert pg.requeue_lapsed(max_attempts=3) == ([], [])            # renewed: nothing lapsed
    lapse(pg, "video_a")
    assert pg.requeue_lapsed(max_attempts=3) == (["video_a"], [])
    assert pg.get("video_a").status == "queued"
    (_, fence_b, attempts, _), = pg.claim("B", ["tiny-latte"], 1, lease_s=30, idle=True)
    assert attempts == 2 and fence_b > fence_a
    assert pg.renew("A", {"video_a": fence_a}, 30) == set()         # A learns that it lost the job
    with pytest.raises(LeaseLost):
        pg.update("video_a", fence=fence_a, status="completed")
    assert pg.release("video_a", fence_a, status="completed") is False
    assert pg.release("video_a", fence_b, status="completed", progress=100) is True
    assert pg.get("video_a").status == "completed" and pg.lease_of("video_a") == (None, fence_b, 2)
    lapse(pg, "video_a")
    assert pg.requeue_lapsed(max_attempts=3) == ([], [])            # completed: not the sweep's


def test_a_job_whose_replicas_keep_dying_fails_after_max_attempts(pg):
    pg.insert(record("video_a"))
    (_, _, attempts, _), = pg.claim("A", ["tiny-latte"], 1, lease_s=30, idle=True)
    lapse(pg, "video_a")
    assert pg.requeue_lapsed(max_attempts=2) == (["video_a"], [])
    (_, _, attempts, _), = pg.claim("B", ["tiny-latte"], 1, lease_s=30, idle=True)
    assert attempts == 2
    lapse(pg, "video_a")
    assert pg.requeue_lapsed(max_attempts=2) == ([], ["video_a"])
    rec = pg.get("video_a")
    assert rec.status == "failed" and rec.error["code"] == "replica_lost"


def test_publication_renames_a_claims_files_only_while_its_fence_holds(pg):
    pg.insert(record("video_a"))
    (_, fence, _, _), = pg.claim("A", ["tiny-latte"], 1, lease_s=30, idle=True)
    for path in (pg.video_path("video_a", fence), pg.thumbnail_path("video_a", fence)):
        path.write_bytes(b"mine")
    lapse(pg, "video_a")
    pg.requeue_lapsed(max_attempts=3)
    (_, fence_b, _, _), = pg.claim("B", ["tiny-latte"], 1, lease_s=30, idle=True)
    assert not pg.video_path("video_a", fence).exists(), "the lapsed claim's files were dropped"
    for path in (pg.video_path("video_a", fence), pg.thumbnail_path("video_a", fence)):
        path.write_bytes(b"late")                     # A, not knowing, finishes its file anyway
    assert pg.publish("video_a", fence, status="completed", progress=100) is False     # A lost it: nothing moves
    assert not pg.video_path("video_a").exists() and pg.get("video_a").status == "queued"
    pg.video_path("video_a", fence_b).write_bytes(b"bee")
    pg.thumbnail_path("video_a", fence_b).write_bytes(b"png")
    assert pg.publish("video_a", fence_b, status="completed", progress=100, bytes=6) is True
    assert pg.video_path("video_a").read_bytes() == b"bee" and not pg.video_path("video_a", fence_b).exists()
    assert pg.get("video_a").status == "completed" and pg.lease_of("video_a")[0] is None


def test_shared_work_replicas_deletes_and_the_one_sweeper(pg):
    from longserve.server.api.pg_admission import SharedLedger

    pg.insert(record("video_a", owner="k"), cost=2.5)
    pg.insert(record("video_b"), cost=1.0)
    pg.insert(record("video_c", status="completed"), cost=7.0)
    ledger = SharedLedger(pg, "A", lease_s=30, whole=True)
    with pg.transaction() as conn:
        assert ledger.work(conn) == 3.5 and ledger.work(conn, "k") == 2.5
    assert pg.existing(["video_a", "video_x"]) == {"video_a"}
    (_, fence, attempts, cost), = pg.claim("A", ["tiny-latte"], 9, lease_s=30, idle=True, look_ahead=1)
    assert (attempts, cost) == (1, 2.5)
    assert pg.unclaim("video_a", fence) is True and pg.lease_of("video_a") == (None, fence, 0)
    pg.heartbeat("A", ["tiny-latte"], {"running": 1})
    pg.heartbeat("B", ["tiny-b"], {})
    assert pg.live_replicas(5) == [("A", ["tiny-latte"], {"running": 1}), ("B", ["tiny-b"], {})]
    pg.leave("B")
    assert [r[0] for r in pg.live_replicas(5)] == ["A"]
    with pg.sweep_lock() as first, pg.sweep_lock() as second:
        assert (first, second) == (True, False)
    with pg.sweep_lock() as again:
        assert again


def test_a_database_that_goes_away_is_unavailable_within_the_timeout_and_the_pool_recovers(pg_url, tmp_path):
    """A PostgreSQL that refuses connections (a proxy in front of the real one, closed: the shared server is not
    touched): every call is StoreUnavailable within --store-timeout, `unavailable` says why (/health's reason),
    and the pool serves again within seconds of the proxy reopening, with no new store. A store URL that cannot
    connect at start is one line naming --store."""
    from urllib.parse import urlsplit

    from tcp_proxy import TCPProxy

    from longserve.server.api.errors import StoreUnavailable
    from longserve.server.api.pg_store import PostgresJobStore
    from longserve.server.api.storage import open_store

    real = urlsplit(pg_url)
    proxy = TCPProxy((real.hostname, real.port or 5432))
    url = pg_url.replace(real.netloc, f"{real.hostname}:{proxy.port}", 1)
    store = PostgresJobStore(url, tmp_path / "data", timeout_s=2)
    try:
        store.insert(record("video_gone"))
        proxy.close()
        for call in (lambda: store.get("video_gone"), lambda: store.page(None, 5, "desc"), store.ping):
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                call()
            assert time.monotonic() - started < 5
        assert store.unavailable
        proxy.open()
        deadline = time.monotonic() + 10
        while True:
            try:
                assert store.get("video_gone").id == "video_gone"
                break
            except StoreUnavailable:
                assert time.monotonic() < deadline, "the pool did not reconnect"
                time.sleep(0.2)
        assert store.unavailable is None
    finally:
        store.close()
        proxy.close()
    proxy_url = url                                  # nothing listens there now
    config = type("Config", (), {"media_store": None, "store": proxy_url, "data_dir": str(tmp_path / "d2"),
                                 "store_timeout_s": 2})
    started = time.monotonic()
    with pytest.raises(ValueError) as bad:
        open_store(config)
    assert time.monotonic() - started < 5
    message = str(bad.value)
    assert message.startswith("--store postgresql://") and "\n" not in message and "refused" in message, message


def test_both_stores_build_the_one_table_definition_and_answer_the_protocol(store):
    """`VIDEO_TABLE` is the videos table of both stores: SQLite creates it from the definition; PostgreSQL's
    versioned migrations (never edited once released) must end in the same columns, types and nullability."""
    if isinstance(store, SqliteJobStore):
        rows = store._all("SELECT name, type, \"notnull\" FROM pragma_table_info('videos')")
        dialect = "sqlite"
    else:
        rows = store._all("SELECT column_name, upper(data_type), is_nullable = 'NO' FROM information_schema.columns "
                          "WHERE table_name = 'videos' AND table_schema = current_schema()")
        dialect = "postgresql"
    found = {name: (kind.replace("CHARACTER VARYING", "TEXT"), bool(not_null)) for name, kind, not_null in rows}
    for name, kind, constraints in VIDEO_TABLE:
        assert name in found, f"{dialect}: videos lacks {name}"
        declared = COLUMN_TYPES[dialect][kind]
        assert found[name][0] == declared, (dialect, name, found[name], declared)
        if kind != "seq":                     # (SQLite reports its rowid key as nullable)
            assert found[name][1] == ("NOT NULL" in constraints), (dialect, name, found[name])
    protocol = {n for n in vars(JobStore) if not n.startswith("_")}
    assert protocol <= set(dir(store)), protocol - set(dir(store))
