"""A webhook receiver on loopback for the tests (tests/server/test_extend_api.py, test_webhooks.py)."""

from __future__ import annotations

import threading
import time


class Receiver:
    """A webhook receiver on loopback: records each POST (headers, body) and answers the next status of `answers`
    (then 200)."""

    def __init__(self, answers=()):
        import http.server

        self.got, self.answers = [], list(answers)
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                receiver.got.append((dict(self.headers.items()), body))
                self.send_response(receiver.answers.pop(0) if receiver.answers else 200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, n: int, timeout_s: float = 30) -> list:
        deadline = time.monotonic() + timeout_s
        while len(self.got) < n:
            assert time.monotonic() < deadline, self.got
            time.sleep(0.05)
        return self.got

    def close(self):
        self.server.shutdown()
        self.server.server_close()
