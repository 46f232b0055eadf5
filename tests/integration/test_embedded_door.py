"""The embedded server's TCP door (fd/control/embedded.py, fd/control/resp.py): what a client of
another process sees is what a Redis would show it — replies in RESP2 or RESP3, errors with
their codes, transactions and WATCH per connection, blocking reads woken by writes through the
other door, and a malformed request answered, not a dead server."""

from __future__ import annotations

import asyncio
import socket
import threading
import uuid

import pytest
import redis
from redis.exceptions import NoScriptError, ResponseError, WatchError

from fd.control.resp import ProtocolError, RequestReader, encode_reply


@pytest.fixture
def k():
    tag = uuid.uuid4().hex[:8]
    return lambda name: f"door-{tag}:{name}"


def test_requests_split_anywhere_come_out_whole():
    raw = b"*3\r\n$3\r\nSET\r\n$1\r\na\r\n$6\r\nx\r\ny z\r\nPING\r\n*1\r\n$4\r\nPING\r\n"
    reader = RequestReader()
    got = []
    for i in range(0, len(raw), 3):
        reader.feed(raw[i : i + 3])
        got += list(reader.requests())
    assert got == [[b"SET", b"a", b"x\r\ny z"], [b"PING"], [b"PING"]]


def test_a_request_that_is_not_resp_is_a_protocol_error():
    reader = RequestReader()
    reader.feed(b"*x\r\n")
    with pytest.raises(ProtocolError):
        list(reader.requests())


def test_replies_in_both_protocols():
    assert encode_reply(b"OK") == b"+OK\r\n"
    assert encode_reply(b"OK", status=False) == b"$2\r\nOK\r\n"
    assert encode_reply([b"OK", 1, None]) == b"*3\r\n$2\r\nOK\r\n:1\r\n$-1\r\n"
    assert encode_reply({b"f": b"v"}) == b"*2\r\n$1\r\nf\r\n$1\r\nv\r\n"
    assert encode_reply({b"f": b"v"}, 3) == b"%1\r\n$1\r\nf\r\n$1\r\nv\r\n"
    assert encode_reply(None, 3) == b"_\r\n" and encode_reply(1.5, 3) == b",1.5\r\n"
    assert encode_reply(NoScriptError("No matching script.")) == b"-NOSCRIPT No matching script.\r\n"
    assert encode_reply(ResponseError("WRONGTYPE Operation")) == b"-WRONGTYPE Operation\r\n"
    assert encode_reply(ResponseError("unknown command 'x'")) == b"-ERR unknown command 'x'\r\n"


@pytest.mark.parametrize("protocol", [2, 3])
def test_a_redis_py_client_of_either_protocol_works_through_the_door(embedded_redis, k, protocol):
    r = redis.Redis(port=embedded_redis.port, protocol=protocol, socket_timeout=5)
    try:
        assert r.ping() is True
        assert r.set(k("s"), "v", ex=100) is True and r.get(k("s")) == b"v"
        r.hset(k("h"), mapping={"a": "1", "b": "2"})
        assert r.hgetall(k("h")) == {b"a": b"1", b"b": b"2"}
        eid = r.xadd(k("x"), {"f": "v"})
        assert r.xrange(k("x")) == [(eid, {b"f": b"v"})]
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            r.get(k("x"))
        with pytest.raises(NoScriptError):
            r.evalsha("0" * 40, 0)
        assert r.eval("return redis.call('GET', KEYS[1])", 1, k("s")) == b"v"
    finally:
        r.close()


def test_transactions_and_watch_are_per_connection(embedded_redis, k):
    a = redis.Redis(port=embedded_redis.port, socket_timeout=5)
    b = redis.Redis(port=embedded_redis.port, socket_timeout=5)
    try:
        a.set(k("n"), 1)
        with a.pipeline(transaction=True) as pipe:
            pipe.watch(k("n"))
            pipe.multi()
            pipe.incr(k("n"))
            b.set(k("n"), 10)  # another connection's write between WATCH and EXEC
            with pytest.raises(WatchError):
                pipe.execute()
        assert a.get(k("n")) == b"10"
        with a.pipeline(transaction=True) as pipe:
            pipe.incr(k("n")).incr(k("n"))
            assert pipe.execute() == [11, 12]
    finally:
        a.close()
        b.close()


async def test_a_blocked_read_through_the_door_wakes_on_an_in_process_write(embedded_redis, k):
    r = redis.Redis(port=embedded_redis.port, socket_timeout=10)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(r.xread({k("x"): "$"}, block=5000)))
    reader.start()
    await asyncio.sleep(0.2)
    client = embedded_redis.client()
    try:
        eid = await client.xadd(k("x"), {"f": "v"})
        await asyncio.to_thread(reader.join, 5)
        assert got and got[0][0][1] == [(eid, {b"f": b"v"})]
    finally:
        await client.aclose()
        r.close()


def test_a_malformed_request_is_answered_and_the_server_goes_on(embedded_redis):
    with socket.create_connection(("127.0.0.1", embedded_redis.port), timeout=5) as s:
        s.sendall(b"*1\r\n:nonsense\r\n")
        assert s.recv(1000).startswith(b"-ERR Protocol error")
    r = redis.Redis(port=embedded_redis.port, socket_timeout=5)
    try:
        assert r.ping() is True
    finally:
        r.close()
