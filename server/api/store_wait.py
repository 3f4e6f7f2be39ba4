"""A PostgreSQL job store that does not answer yet at start (the database starting beside the replicas): tried
again with backoff for `--store-wait`, a line each try, then one error naming why (`store.StoreUnavailable`, which the
start turns into one line naming --store)."""

from __future__ import annotations

import logging
import re
import time

import psycopg

from longserve.server.api.config import safe_url

log = logging.getLogger("longserve.server")

#: a database that answers but refuses us: waiting will not help (a wrong password, user or database name)
REFUSED = re.compile(r"authentication failed|role .* does not exist|database .* does not exist|no pg_hba\.conf entry|"
                     r"password authentication|SSL", re.I)


def wait_for_database(url: str, wait_s: float) -> None:
    """Connect once to `url`, trying again with backoff (0.5 s doubling, at most 8 s apart) while it does not answer,
    for up to `wait_s` seconds (a debug line per failed try: the failure is told once, by the caller). StoreUnavailable
    when it never answers, or at once when it refuses (authentication, an unknown database)."""
    from longserve.server.api.errors import StoreUnavailable

    deadline = time.monotonic() + wait_s
    delay, tries = 0.5, 0
    while True:
        tries += 1
        remaining = deadline - time.monotonic()
        try:
            psycopg.connect(url, connect_timeout=max(2, min(10, int(remaining) + 1))).close()
            return
        except psycopg.Error as e:
            reason = " ".join(str(e).split())[:300] or type(e).__name__
            if REFUSED.search(reason):
                raise StoreUnavailable(f"the database refused the connection: {reason}") \
                    from None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreUnavailable(f"the database did not answer within --store-wait "
                                       f"{wait_s:g} s ({tries} tries; last: {reason})") from None
            log.debug("the job store %s does not answer (%s); trying again in %.1f s (gives up %.0f s from now)",
                        safe_url(url), reason, min(delay, remaining), remaining)
            time.sleep(min(delay, remaining))
            delay = min(8.0, delay * 2)
