"""A fresh PostgreSQL schema for a test module, on the server at $LONGSERVE_TEST_POSTGRES (default
postgresql://127.0.0.1:5432/test: every machine of this project runs one, trust authentication). Tests that need it
skip, saying how to run them, when none answers."""

from __future__ import annotations

import contextlib
import os
import uuid
from urllib.parse import quote

DEFAULT_URL = "postgresql://127.0.0.1:5432/test"
HOW_TO = ("no PostgreSQL answers at {url} ({error}); start one (Debian: pg_ctlcluster --skip-systemctl-redirect "
          "$(ls /etc/postgresql) main start) or set LONGSERVE_TEST_POSTGRES=postgresql://user@host:port/db")


def server_url() -> str:
    return os.environ.get("LONGSERVE_TEST_POSTGRES") or DEFAULT_URL


def with_schema(url: str, schema: str) -> str:
    """`url` whose connections use `schema` (libpq's options parameter)."""
    return f"{url}{'&' if '?' in url else '?'}options={quote(f'-csearch_path={schema}')}"


@contextlib.contextmanager
def fresh_schema(prefix: str = "ls_test"):
    """Yields a URL on a new, empty schema; the schema is dropped afterwards. pytest.skip when no server answers."""
    import psycopg
    import pytest

    url = server_url()
    try:
        admin = psycopg.connect(url, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as e:
        pytest.skip(HOW_TO.format(url=url, error=str(e).strip().splitlines()[0]))
    schema = f"{prefix}_{uuid.uuid4().hex[:12]}"
    try:
        admin.execute(f"CREATE SCHEMA {schema}")
        yield with_schema(url, schema)
    finally:
        admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        admin.close()
