"""The embedded control plane for ``fd serve``: a fakeredis server that also listens on TCP.

One :class:`fakeredis.FakeServer` holds the data. Two doors lead to it, both through
fakeredis's public clients:

- :meth:`EmbeddedRedis.client`, an in-process ``FakeAsyncRedis`` bound to the server object:
  no socket, no per-connection thread; its blocking reads are woken by the server's writes;
- a TCP listener (:class:`_Door`, a thread per connection), so an operator can
  ``redis-cli -p <port> XADD fd:control '*' type abort request_id r1`` into a running
  ``fd serve`` exactly as into a real Redis, and an ``fd engine`` of another process can join.
  Each connection speaks RESP2 to a synchronous ``FakeRedis`` of its own (so ``MULTI``,
  ``WATCH`` and blocking reads keep their per-connection state), and ``INFO``, which fakeredis
  does not have, is answered here (fd/control/embedded_info.py).

Writes through either door are seen by readers on the other. This module uses fakeredis's
documented API only: ``FakeServer(version=...)``, ``FakeRedis``/``FakeAsyncRedis(server=...)``
and their commands (``DBSIZE`` walks the keyspace, which drops keys past their TTL). The bus's
store on the in-process client is another matter: :class:`~fd.control.embedded_store.EmbeddedStore`
does a step's hot work on fakeredis's own objects, on the fakeredis releases it was verified on
only (fd/control/embedded_store.py says what it touches and why); on any other release every
operation goes through the commands, as on a real Redis, so fakeredis can be upgraded without
breaking ``fd serve``, only slowing it (one log line says so).
"""

from __future__ import annotations

import logging
import socketserver
import threading
from collections.abc import Callable
from typing import Any

import fakeredis
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from fd.control.connect import MAX_CONNECTIONS, POOL_WAIT_S
from fd.control.embedded_info import REDIS_VERSION, InfoValue, ServerInfo, parse_info
from fd.control.embedded_store import AppendListeners, EmbeddedStore, direct_verified
from fd.control.resp import ProtocolError, RequestReader, encode_reply

log = logging.getLogger("fd.control.embedded")


class _Client(fakeredis.FakeAsyncRedis):
    """The in-process client: fakeredis's, answering ``INFO`` as the TCP door does, with the
    store the bus uses on it (fd/control/embedded_store.py)."""

    server_info: ServerInfo
    _store: EmbeddedStore

    def store(self) -> EmbeddedStore:
        return self._store

    async def info(  # (redis-py's signature)
        self, section: str | bytes | None = None, *args: str | bytes, **kwargs: Any
    ) -> dict[str, InfoValue]:
        asked = [a.encode() if isinstance(a, str) else a for a in ((section, *args) if section else ())]
        return parse_info(self.server_info.render(asked))


class _Connection(socketserver.StreamRequestHandler):
    """One TCP client: RESP requests in, each run on this connection's own client, replies
    out. It speaks RESP2 until the client says ``HELLO 3``, as a Redis does."""

    server: _Door
    protocol = 2
    client: fakeredis.FakeRedis

    def _connect(self, protocol: int) -> None:
        self.protocol = protocol
        self.client = fakeredis.FakeRedis(
            server=self.server.fake_server, single_connection_client=True, protocol=protocol
        )
        self.client.response_callbacks.clear()  # the server's replies as they are, to send on

    def handle(self) -> None:
        door = self.server
        self._connect(2)
        reader = RequestReader()
        with door.clients_lock:
            door.clients += 1
        try:
            while not door.closing.is_set():
                data = self.request.recv(65536)
                if not data:
                    return
                reader.feed(data)
                out = []
                for args in reader.requests():
                    out.append(self._run(args))
                    if args and args[0].upper() == b"QUIT":
                        self.wfile.write(b"".join(out))
                        return
                if out:
                    self.wfile.write(b"".join(out))
        except ProtocolError as e:
            self.wfile.write(b"-ERR Protocol error: %s\r\n" % str(e).encode())
        except (ConnectionError, OSError):
            return
        finally:
            with door.clients_lock:
                door.clients -= 1
            self.client.close()

    def _run(self, args: list[bytes]) -> bytes:
        if not args:
            return b""
        name = args[0].upper()
        if name == b"INFO":
            return encode_reply(self.server.info.render(args[1:]), self.protocol, status=False)
        if name == b"QUIT":
            return b"+OK\r\n"
        if name == b"HELLO":
            return self._hello(args[1:])
        try:
            reply = self.client.execute_command(*args)  # type: ignore[no-untyped-call]  # (unannotated in redis-py)
            return encode_reply(reply, self.protocol)
        except ResponseError as e:
            return encode_reply(e)
        except Exception as e:  # a command fakeredis could not run: the client's error, not ours
            log.warning("embedded server: %r failed: %s", args[0], e)
            return encode_reply(ResponseError(f"ERR {e}"))

    def _hello(self, args: list[bytes]) -> bytes:
        if args:
            try:
                protocol = int(args[0])
            except ValueError:
                return b"-ERR Protocol version is not an integer or out of range\r\n"
            if protocol not in (2, 3):
                return b"-NOPROTO unsupported protocol version\r\n"
            if protocol != self.protocol:
                self.client.close()
                self._connect(protocol)
        version = ".".join(map(str, REDIS_VERSION))
        return encode_reply(
            {
                b"server": b"redis",
                b"version": version.encode(),
                b"proto": self.protocol,
                b"id": id(self) & 0xFFFFFFF,
                b"mode": b"standalone",
                b"role": b"master",
                b"modules": [],
            },
            self.protocol,
        )


class _Door(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        address: tuple[str, int],
        fake_server: fakeredis.FakeServer,
        port_info: Callable[[_Door], ServerInfo],
    ):
        self.fake_server = fake_server
        self.closing = threading.Event()
        self.clients = 0
        self.clients_lock = threading.Lock()
        super().__init__(address, _Connection)
        self.info = port_info(self)


class EmbeddedRedis:
    """In-process fakeredis server that also listens on ``host:port`` so redis-cli works."""

    #: How often keys past their TTL are removed. fakeredis drops an expired key only when it
    #: is touched or the keyspace is walked (``DBSIZE``); a finished request's stream is never
    #: touched again, so without this it stayed in memory for the life of `fd serve`. Redis
    #: runs the same kind of active expiry cycle (10 times a second, sampling).
    EXPIRE_EVERY_S = 1.0

    #: ``fd serve``'s default ``--request-ttl`` on this server: 10 minutes, not a real Redis's
    #: hour. A finished request's keys (its story, ~12 KB with a few hundred tokens, and its
    #: owner key) live in this process's memory for the TTL, in Python objects, with no
    #: ``maxmemory`` to bound them: at 100 requests/s an hour held ~4 GB, ten minutes hold
    #: ~0.7 GB, still time for a client to resume a stream, retrieve a response or go on from
    #: it (``previous_response_id``) shortly after.
    REQUEST_TTL_S = 600

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host = host
        self._requested_port = port
        self.port = port
        self._server = fakeredis.FakeServer(version=REDIS_VERSION[:2])
        self._door: _Door | None = None
        self._thread: threading.Thread | None = None
        self._expirer: threading.Thread | None = None
        self._stopped = threading.Event()
        self._direct: bool | None = None  # fd/control/embedded_store.py's version check, once
        self._listeners = AppendListeners()  # (every in-process client's store tells the same)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}"

    @property
    def fake_server(self) -> fakeredis.FakeServer:
        if self._door is None:
            raise RuntimeError("EmbeddedRedis is not started")
        return self._server

    def start(self) -> None:
        if self._door is not None:
            return
        server = self._server
        self._door = _Door(
            (self.host, self._requested_port),
            server,
            lambda door: ServerInfo(server, door.server_address[1], lambda: door.clients),
        )
        self.port = self._door.server_address[1]
        self._thread = threading.Thread(
            target=self._door.serve_forever,
            kwargs={"poll_interval": 0.1},
            name=f"embedded-redis:{self.port}",
            daemon=True,
        )
        self._thread.start()
        self._stopped.clear()
        self._expirer = threading.Thread(
            target=self._expire_cycle, name=f"embedded-redis-expiry:{self.port}", daemon=True
        )
        self._expirer.start()

    def _expire_cycle(self) -> None:
        client = fakeredis.FakeRedis(server=self._server)
        while not self._stopped.wait(self.EXPIRE_EVERY_S):
            client.dbsize()  # (walks the keyspace: what is past its TTL goes)

    def stop(self) -> None:
        """Stop listening and close every TCP connection."""
        door, self._door = self._door, None
        if door is None:
            return
        self._stopped.set()
        door.closing.set()
        door.shutdown()
        door.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._expirer is not None:
            self._expirer.join(timeout=5)
            self._expirer = None

    def client(self) -> aioredis.Redis:
        """A client for code in this process, on the same data the TCP port serves."""
        door = self._door
        if door is None:
            raise RuntimeError("EmbeddedRedis is not started")
        client = _Client(
            server=self._server,
            decode_responses=False,
            protocol=2,
            connection_pool_class=aioredis.BlockingConnectionPool,
            max_connections=MAX_CONNECTIONS,
            timeout=POOL_WAIT_S,
        )
        client.server_info = door.info
        if self._direct is None:
            self._direct = direct_verified()
        client._store = EmbeddedStore(client, self._server, self._direct, self._listeners)
        return client

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
