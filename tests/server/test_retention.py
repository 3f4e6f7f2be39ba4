"""`--retention` (ServeConfig.retention_s): a finished video gets `expires_at` and is deleted with its files once
it passes; a data dir written before the column existed is migrated. The option was added the way every
option is (a config field, the code that uses it, this test)."""

import sqlite3
import time

import pytest
from servers import serving

from server.api.metrics import parse_text
from server.api.store import JobStore


def test_a_finished_video_expires_with_its_files(tmp_path, http_client):
    with serving(tmp_path / "data", model="tiny-latte", workers=1, retention_s=60, default_steps=2) as s:
        http = http_client(s["url"])
        v = http.post("/v1/videos", json={"prompt": "a red ball", "size": "32x32", "num_frames": 4}).json()
        assert v["expires_at"] is None, "a video that is not finished does not expire"
        deadline = time.monotonic() + 60
        while (v := http.get(f"/v1/videos/{v['id']}").json())["status"] != "completed":
            assert time.monotonic() < deadline and v["status"] != "failed", v
            time.sleep(0.05)
        assert v["expires_at"] == v["completed_at"] + 60
        files = list((tmp_path / "data" / "videos").glob(f"{v['id']}*"))
        assert len(files) == 2, "the MP4 and its thumbnail"
        service = s["service"]
        assert service.expire(now=v["expires_at"] - 1) == []
        assert http.get(f"/v1/videos/{v['id']}").status_code == 200
        assert service.expire(now=v["expires_at"]) == [v["id"]]
        assert http.get(f"/v1/videos/{v['id']}").status_code == 404
        assert not any(f.exists() for f in files)
        assert v["id"] not in [x["id"] for x in http.get("/v1/videos").json()["data"]]
        assert parse_text(http.get("/metrics").text)["longserve_jobs_expired_total"] == 1


@pytest.mark.parametrize("bad", [0, -5, float("nan"), True])
def test_retention_must_be_a_positive_number_of_seconds(bad):
    from server.api.service import ServeConfig

    with pytest.raises(ValueError, match="retention_s"):
        ServeConfig.from_options(retention_s=bad)


def test_a_data_dir_from_before_retention_gets_the_expires_at_column(tmp_path):
    old = sqlite3.connect(tmp_path / "longserve.db")
    old.execute("CREATE TABLE videos (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, created_at "
                "INTEGER NOT NULL, completed_at INTEGER, status TEXT NOT NULL, progress INTEGER NOT NULL DEFAULT 0, "
                "model TEXT NOT NULL, prompt TEXT NOT NULL, seconds TEXT NOT NULL, size TEXT NOT NULL, "
                "params TEXT NOT NULL, error TEXT)")
    old.execute("INSERT INTO videos (id, created_at, status, model, prompt, seconds, size, params) VALUES "
                "('video_old', 1, 'completed', 'm', 'p', '1', '32x32', '{}')")
    old.commit()
    old.close()
    store = JobStore(tmp_path)
    try:
        rec = store.get("video_old")
        assert rec is not None and rec.expires_at is None
        store.update("video_old", expires_at=5)
        assert store.expired(now=5) == ["video_old"] and store.expired(now=4) == []
    finally:
        store.close()
