"""`SharedLedger`: admission over every replica's work, with a PostgreSQL store (`--store postgresql://`).

The admission gate (`server/api/admission.py`) has one accounting path: a job's cost is checked against the work of
every active job -- queued and running videos, and live sessions -- of everyone (`--max-queued-work`) and of its
owner (`--max-work-per-key`). One server counts its job registry. Replicas count the shared store: the videos' rows
(queued or in progress, with their `cost`) and the `sessions` table, where each replica keeps its open live
sessions (renewed with its leases; a dead replica's sessions lapse and count no more).

The check and the insert are one transaction under an advisory lock, so two replicas never both take the last room:
the whole schema's lock when there is a limit on everyone's work, else the owner's (creates of different keys do not
wait on each other). The lock is released when the transaction ends.
"""

from __future__ import annotations

from typing import Callable

from longserve.server.api.jobs import LIVE, Job

#: work of the active jobs (of one owner, or everyone's): queued and running videos, and live sessions not lapsed
WORK_SQL = ("SELECT (SELECT COALESCE(SUM(cost), 0) FROM videos WHERE status IN ('queued', 'in_progress'){owner}) + "
            "(SELECT COALESCE(SUM(cost), 0) FROM sessions WHERE lease_until > now(){owner})")
#: the admission lock: (this schema's, an owner's or everyone's), as two int4 keys
LOCK_SQL = ("SELECT pg_advisory_xact_lock(hashtext('longserve-admission:' || COALESCE(current_schema(), '')), "
            "hashtext(%s))")
EVERYONE = "\x01everyone"        # the lock key of the limit on everyone's work (no owner id looks like it)


class SharedLedger:
    """`store`: a `PostgresJobStore`; `replica`: this replica's id; `lease_s`: its leases' length; `whole`: a limit
    on everyone's work exists (the schema-wide lock is taken)."""

    def __init__(self, store, replica: str, lease_s: float, whole: bool):
        self.store, self.replica, self.lease_s, self.whole = store, replica, float(lease_s), whole

    def work(self, conn, owner: str | None = None) -> float:
        """Work of every replica's active jobs (of `owner`, when given), read in `conn`'s transaction."""
        if owner is None:
            return float(conn.execute(WORK_SQL.format(owner="")).fetchone()[0])
        return float(conn.execute(WORK_SQL.format(owner=" AND owner = %s"), (owner, owner)).fetchone()[0])

    def admit(self, job: Job, check: Callable[[Callable], None], here: bool) -> None:
        """Under the lock: `check(work_of)` (raises to refuse), then the job is stored: a live session's row, or a
        video's record (`job.record`), claimed by this replica at once when it runs `here` (its fence: 1)."""
        with self.store.transaction() as conn:
            conn.execute(LOCK_SQL, (EVERYONE if self.whole or job.owner is None else job.owner,))
            check(lambda owner=None: self.work(conn, owner))
            if job.kind == LIVE:
                conn.execute("INSERT INTO sessions (id, owner, cost, replica, lease_until) VALUES (%s, %s, %s, %s, "
                             "now() + make_interval(secs => %s))",
                             (job.id, job.owner, float(job.cost), self.replica, self.lease_s))
            else:
                self.store.insert(job.record, job.cost, conn=conn,
                                  lease=(self.replica, self.lease_s) if here else None)
                if here:
                    job.fence = 1

    def release(self, job: Job) -> None:
        """A live session ended: its work is free for every replica."""
        if job.kind == LIVE:
            self.store.execute("DELETE FROM sessions WHERE id = %s", (job.id,))

    def renew(self, session_ids) -> None:
        """This replica's open sessions stay counted for another lease; lapsed ones of any replica go."""
        ids = list(session_ids)
        if ids:
            self.store.execute("UPDATE sessions SET lease_until = now() + make_interval(secs => %s) WHERE replica = "
                               "%s AND id = ANY(%s)", (self.lease_s, self.replica, ids))
        self.store.execute("DELETE FROM sessions WHERE lease_until < now() - make_interval(secs => %s)",
                           (self.lease_s,))

    def leave(self) -> None:
        self.store.execute("DELETE FROM sessions WHERE replica = %s", (self.replica,))
