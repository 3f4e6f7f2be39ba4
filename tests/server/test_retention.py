"""`--retention` and `--max-storage-bytes` (ServeConfig): the values they take, and a data dir written before their
columns existed (migrated on open). What they do to videos is in tests/server/test_storage.py."""

import json
import sqlite3

import pytest

from longserve.server.api.store import SqliteJobStore


@pytest.mark.parametrize("bad", [0, -5, float("nan"), True])
def test_retention_must_be_a_positive_number_of_seconds(bad):
    from longserve.server.api.service import ServeConfig

    with pytest.raises(ValueError, match="retention_s"):
        ServeConfig.from_options(retention_s=bad)


@pytest.mark.parametrize("name,bad", [("max_storage_bytes", 0), ("max_storage_bytes", 1.5),
                                      ("min_free_bytes", -1), ("drain_seconds", float("inf"))])
def test_storage_and_drain_options_refuse_bad_values_by_name(name, bad):
    from longserve.server.api.service import ServeConfig

    with pytest.raises(ValueError, match=f"{name} must be"):
        ServeConfig.from_options(**{name: bad})


def test_retention_defaults_to_a_week_and_none_keeps_videos():
    from longserve.server.api.service import ServeConfig

    assert ServeConfig().retention_s == 7 * 24 * 3600
    assert ServeConfig.from_options(retention_s=None).retention_s is None


def test_a_data_dir_from_before_retention_gets_the_new_columns(tmp_path):
    old = sqlite3.connect(tmp_path / "longserve.db")
    old.execute("CREATE TABLE videos (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, created_at "
                "INTEGER NOT NULL, completed_at INTEGER, status TEXT NOT NULL, progress INTEGER NOT NULL DEFAULT 0, "
                "model TEXT NOT NULL, prompt TEXT NOT NULL, seconds TEXT NOT NULL, size TEXT NOT NULL, "
                "params TEXT NOT NULL, error TEXT)")
    old.execute("INSERT INTO videos (id, created_at, completed_at, status, model, prompt, seconds, size, params) "
                "VALUES ('video_old', 1, 1, 'completed', 'm', 'p', '1', '32x32', '{}')")
    # an older release stored a lone surrogate in a negative prompt (issue 32): it comes back encodable
    old.execute("INSERT INTO videos (id, created_at, completed_at, status, model, prompt, seconds, size, params) "
                "VALUES ('video_odd', 2, 2, 'completed', 'm', 'p', '1', '32x32', ?)",
                ['{"negative_prompt": "a\\ud800"}'])
    old.commit()
    old.close()
    store = SqliteJobStore(tmp_path)
    try:
        rec = store.get("video_old")
        assert rec is not None and rec.expires_at is None and rec.expired is False and rec.bytes is None
        # keys are tenants: a row from before owners has none; only a view of every owner lists it
        odd = store.get("video_odd").params["negative_prompt"]
        assert odd == "a\\ud800" and json.dumps(odd, ensure_ascii=False).encode()
        store.delete("video_odd")
        assert rec.owner is None and store.page(None, 10, "desc")[0] == [rec]
        assert store.page(None, 10, "desc", owner="key-a") == ([], False)
        assert store.completed_with_key("k", None) is None
        assert store.unmeasured() == ["video_old"]
        store.update("video_old", expires_at=5, bytes=10)
        assert store.expired(now=5) == ["video_old"] and store.expired(now=4) == []
        assert store.stored() == [("video_old", None, "video_old", 10, 5)]
        store.update("video_old", expired=True)
        assert store.expired(now=5) == [] and store.stored() == [] and store.get("video_old").expired is True
    finally:
        store.close()
