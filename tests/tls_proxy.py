"""A TLS front for a plain Redis server (the bundled redis-server is built without TLS).

Clients speak real TLS to the proxy, which verifies nothing itself and
forwards bytes to Redis on 127.0.0.1: enough to check that ``rediss://``
URLs, certificates and credentials travel as redis-py expects.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import ssl
import threading


class TLSProxy:
    """Accept TLS on a free loopback port; relay each connection to ``target_port``."""

    def __init__(self, target_port: int, context: ssl.SSLContext) -> None:
        self.target_port = target_port
        self.context = context
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = int(self.listener.getsockname()[1])
        self.stopping = threading.Event()
        self.sockets: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> TLSProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(5)
        for sock in [self.listener, *self.sockets]:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                raw, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            try:
                raw.settimeout(5)
                client = self.context.wrap_socket(raw, server_side=True)
            except (ssl.SSLError, OSError):
                raw.close()  # a failed handshake ends that connection only
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            self.sockets += [client, upstream]
            threading.Thread(target=self._relay, args=(client, upstream), daemon=True).start()

    def _relay(self, client: ssl.SSLSocket, upstream: socket.socket) -> None:
        """Both directions in one thread: an SSL socket must not be read and written
        from two threads at once (a thread per direction closed connections now and
        then under load: "Connection closed by server" in a CI run)."""
        selector = selectors.DefaultSelector()
        selector.register(client, selectors.EVENT_READ)
        selector.register(upstream, selectors.EVENT_READ)
        try:
            with contextlib.suppress(OSError), selector:
                while not self.stopping.is_set():
                    ready = [key.fileobj for key, _ in selector.select(timeout=0.2)]
                    if client.pending() and client not in ready:
                        ready.append(client)  # decrypted bytes the selector cannot see
                    for src in ready:
                        assert isinstance(src, socket.socket)
                        dst = upstream if src is client else client
                        try:
                            data = src.recv(65536)
                        except (ssl.SSLWantReadError, TimeoutError):
                            continue
                        if not data:
                            return
                        dst.sendall(data)
        finally:
            for sock in (client, upstream):
                with contextlib.suppress(OSError):
                    sock.close()
