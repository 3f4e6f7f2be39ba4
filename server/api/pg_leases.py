"""`ReplicaRows`: what the replicas do with the PostgreSQL store's rows beyond the SQLite store's interface: claims
under leases and fences, lapsed leases, publication, the live replicas, the one sweeper. A part of
`PostgresJobStore` (`server/api/pg_store.py`), which gives it its connections.
"""

from __future__ import annotations

import contextlib
import json

from longserve.server.api.store import COLUMNS, VideoRecord, dump_json, record_from_row

#: the retention and quota sweep: one replica of a schema sweeps at a time (an advisory lock's first key; the
#: schema's hash is the second)
SWEEP_LOCK = 0x6C6F6E67 + 1
_WRITABLE = frozenset(COLUMNS) - {"seq", "id"}


class LeaseLost(RuntimeError):
    """A replica's write under a fence that is no longer the job's: another replica claimed it since."""


class ReplicaRows:
    """Claims, leases, publication and the replicas' table (`PostgresJobStore` mixes it in: `_connection`,
    `_one`, `_all`, `_run` and the media files are its)."""

    # -- leases (replicas) ---------------------------------------------------------------------------

    def claim(self, replica: str, models, budget: float, lease_s: float, idle: bool,
              look_ahead: int = 16) -> list[tuple[VideoRecord, int, int, float]]:
        """Claim queued jobs of `models`, oldest first, whose work fits `budget` (at least one when `idle`): each
        gets this replica's lease for `lease_s`, an attempt and a new fence. Rows another replica is claiming are
        skipped (FOR UPDATE SKIP LOCKED). Returns (record, fence, attempts, cost) of each."""
        with self._connection() as conn, conn.transaction():
            rows = conn.execute("SELECT id, cost FROM videos WHERE status = 'queued' AND lease_owner IS NULL AND "
                                "model = ANY(%s) ORDER BY seq LIMIT %s FOR UPDATE SKIP LOCKED",
                                (list(models), look_ahead)).fetchall()
            chosen, total = [], 0.0
            for video_id, cost in rows:
                if total + cost > budget and not (idle and not chosen):
                    break
                chosen.append(video_id)
                total += cost
            if not chosen:
                return []
            claimed = conn.execute(
                f"UPDATE videos SET lease_owner = %s, lease_until = now() + make_interval(secs => %s), "
                f"attempts = attempts + 1, fence = fence + 1 WHERE id = ANY(%s) RETURNING "
                f"{', '.join(COLUMNS)}, fence, attempts, cost", (replica, float(lease_s), chosen)).fetchall()
        n = len(COLUMNS)
        out = [(record_from_row(r[:n]), r[n], r[n + 1], r[n + 2]) for r in claimed]
        return sorted(out, key=lambda c: c[0].seq)

    def renew(self, replica: str, fences: dict[str, int], lease_s: float) -> set[str]:
        """Extend this replica's leases of these jobs (id -> fence); the ids whose lease still held."""
        if not fences:
            return set()
        rows = self._all("UPDATE videos v SET lease_until = now() + make_interval(secs => %s) FROM "
                         "unnest(%s::text[], %s::bigint[]) AS h(id, fence) WHERE v.id = h.id AND v.fence = h.fence "
                         "AND v.lease_owner = %s RETURNING v.id",
                         (float(lease_s), list(fences), list(fences.values()), replica))
        return {r[0] for r in rows}

    def release(self, video_id: str, fence: int, **fields) -> bool:
        """A claim's last write: the fields, and the lease let go, only while `fence` holds; False otherwise."""
        sql, args = update_sql(video_id, fields, " AND fence = %s", (fence,))
        sql = sql.replace("UPDATE videos SET ", "UPDATE videos SET lease_owner = NULL, lease_until = NULL, " if fields
                          else "UPDATE videos SET lease_owner = NULL, lease_until = NULL", 1)
        return self._run(sql, args) > 0

    def unclaim(self, video_id: str, fence: int) -> bool:
        """Give a claim back untried (its replica could not queue it): queued for any replica, the attempt undone."""
        return self._run("UPDATE videos SET lease_owner = NULL, lease_until = NULL, attempts = attempts - 1 WHERE id = "
                         "%s AND fence = %s AND status = 'queued'", (video_id, fence)) > 0

    def requeue_lapsed(self, max_attempts: int) -> tuple[list[str], list[str]]:
        """Jobs whose lease lapsed (their replica stopped renewing): queued again while they have attempts left,
        else failed (`replica_lost`). Returns (requeued ids, failed ids)."""
        with self._connection() as conn, conn.transaction():
            lapsed = conn.execute("SELECT id, attempts, fence FROM videos WHERE lease_owner IS NOT NULL AND "
                                  "lease_until < now() AND status IN ('queued', 'in_progress') FOR UPDATE SKIP LOCKED"
                                  ).fetchall()
            again = [i for i, attempts, _ in lapsed if attempts < max_attempts]
            lost = [i for i, attempts, _ in lapsed if attempts >= max_attempts]
            if again:
                conn.execute("UPDATE videos SET status = 'queued', progress = 0, lease_owner = NULL, lease_until = "
                             "NULL WHERE id = ANY(%s)", (again,))
            if lost:
                error = dump_json({"code": "replica_lost", "message": f"the replica running this video stopped "
                                                                  f"{max_attempts} times; it was not retried again"})
                conn.execute("UPDATE videos SET status = 'failed', lease_owner = NULL, lease_until = NULL, error = "
                             "%s, completed_at = EXTRACT(EPOCH FROM now())::bigint WHERE id = ANY(%s)", (error, lost))
        for video_id, _, fence in lapsed:          # what the lost claims wrote: their own files only
            self.remove_files(video_id, fence)
        for video_id in lost if self.shared else ():     # failed for good: their uploads go too
            self.remove_inputs(video_id)
        return again, lost

    def job_state(self, video_id: str) -> tuple[str, int, str | None, int] | None:
        """(status, progress, lease owner, fence) of a job, in one query (another replica's watch of it); None when
        there is no such job."""
        return self._one("SELECT status, progress, lease_owner, fence FROM videos WHERE id = %s", (video_id,))

    def lease_of(self, video_id: str) -> tuple[str | None, int, int] | None:
        """(lease owner, fence, attempts) of a job; None when there is no such job."""
        return self._one("SELECT lease_owner, fence, attempts FROM videos WHERE id = %s", (video_id,))

    def set_cost(self, video_id: str, cost: float) -> None:
        self._run("UPDATE videos SET cost = %s WHERE id = %s", (float(cost), video_id))

    def publish(self, video_id: str, fence: int, **fields) -> bool:
        """Complete a claim's video: while `fence` still holds the row (locked), its files `<id>.f<fence>.*` become
        `<id>.*` (`publish_files`: renamed, atomic on one file system; or put whole as objects) and the fields are
        written, the lease let go. False, with nothing published, when another claim holds the job. (A lapsed lease
        is not requeued while the row is locked: `requeue_lapsed` skips locked rows.)"""
        with self._connection() as conn, conn.transaction():
            row = conn.execute("SELECT fence FROM videos WHERE id = %s FOR UPDATE", (video_id,)).fetchone()
            if row is None or row[0] != fence:
                return False
            self.publish_files(video_id, fence)
            sql, args = update_sql(video_id, fields, " AND fence = %s", (fence,))
            conn.execute(sql.replace("SET ", "SET lease_owner = NULL, lease_until = NULL, ", 1), args)
        self.published(video_id, fence)
        return True

    def existing(self, ids) -> set[str]:
        """Which of these jobs still have a record (a DELETE on any replica removes it)."""
        ids = list(ids)
        return {r[0] for r in self._all("SELECT id FROM videos WHERE id = ANY(%s)", (ids,))} if ids else set()

    def heartbeat(self, replica: str, models, info: dict) -> None:
        self._run("INSERT INTO replicas (id, models, info, heartbeat) VALUES (%s, %s, %s, now()) ON CONFLICT (id) "
                  "DO UPDATE SET models = EXCLUDED.models, info = EXCLUDED.info, heartbeat = now()",
                  (replica, list(models), json.dumps(info)))

    def live_replicas(self, within_s: float) -> list[tuple[str, list[str], dict]]:
        """(id, models, info) of the replicas that beat within `within_s` seconds."""
        rows = self._all("SELECT id, models, info FROM replicas WHERE heartbeat > now() - make_interval(secs => %s) "
                         "ORDER BY id", (float(within_s),))
        return [(i, list(models), json.loads(info)) for i, models, info in rows]

    def leave(self, replica: str) -> None:
        self._run("DELETE FROM replicas WHERE id = %s", (replica,))

    @contextlib.contextmanager
    def sweep_lock(self):
        """A context: True inside it for the one replica that sweeps now (a session advisory lock), else False."""
        with self._connection() as conn:
            held = conn.execute("SELECT pg_try_advisory_lock(%s, hashtext(COALESCE(current_schema(), '')))",
                                (SWEEP_LOCK,)).fetchone()[0]
            try:
                yield held
            finally:
                if held:
                    conn.execute("SELECT pg_advisory_unlock(%s, hashtext(COALESCE(current_schema(), '')))",
                                 (SWEEP_LOCK,))



def update_sql(video_id: str, fields: dict, where: str = "", args=()) -> tuple[str, tuple]:
    """UPDATE of a record's fields (JSON columns dumped), with more conditions after the id's."""
    unknown = set(fields) - _WRITABLE
    if unknown:
        raise ValueError(f"not a writable column of videos: {sorted(unknown)}")
    values = dict(fields)
    for name in ("error", "params"):
        if name in values:
            values[name] = dump_json(values[name])
    if "expired" in values:
        values["expired"] = int(values["expired"])
    sets = ", ".join(f"{k} = %s" for k in values)
    return f"UPDATE videos SET {sets} WHERE id = %s{where}", (*values.values(), video_id, *args)
