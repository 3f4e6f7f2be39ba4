"""A TCP proxy on a loopback port of its own, in front of a real server (the machine's PostgreSQL): a test points a
server at it, then `close()`s it -- the port refuses connections and every open one is cut, as a database that went
away -- and `open()`s it again on the same port, without touching the shared server behind it."""

from __future__ import annotations

import contextlib
import socket
import threading


class TCPProxy:
    def __init__(self, target: tuple[str, int], host: str = "127.0.0.1"):
        self.target, self.host = target, host
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._listener = None
        with socket.socket() as probe:          # a free port, kept across close() and open()
            probe.bind((host, 0))
            self.port = probe.getsockname()[1]
        self.open()

    def open(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), name="tcp-proxy", daemon=True).start()

    def close(self) -> None:
        """Refuse new connections and cut the open ones."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return                                # closed
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._listener is not listener:    # closed meanwhile
                    client.close()
                    upstream.close()
                    return
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
