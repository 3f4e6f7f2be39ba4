"""The API tests' one server a test process (`tests/support/api_server.py`): test_api.py and test_api_requests.py
both run on it, made once when both land in the same pytest-xdist process."""

import httpx
import pytest
from api_server import api_server


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    with api_server(tmp_path_factory.mktemp("serve-data")) as s:
        yield s


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server["url"], timeout=60) as c:
        yield c
