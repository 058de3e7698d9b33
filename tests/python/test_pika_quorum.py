"""Quorum queues with pika against a running `warren serve` (or RabbitMQ 3.10, which these
tests were checked against: WARREN_AMQP=host:port of either).

Broker address from WARREN_AMQP (host:port), default 127.0.0.1:5672.
"""
import os
import time
import uuid

import pika
import pytest

from conftest import within

HOST, PORT = os.environ.get("WARREN_AMQP", "127.0.0.1:5672").rsplit(":", 1)
QUORUM = {"x-queue-type": "quorum"}


@pytest.fixture
def conn():
    params = pika.ConnectionParameters(
        host=HOST, port=int(PORT), blocked_connection_timeout=10, socket_timeout=10
    )
    with within("connection.open-ok"):
        c = pika.BlockingConnection(params)
    yield c
    if c.is_open:
        with within("connection.close-ok"):
            c.close()


def unique(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def refused(conn, name, **kw):
    """The 406 a declare gets (on a channel of its own), as (code, text)."""
    ch = conn.channel()
    with within(f"channel.close for the declare of {name} {kw}"):
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            ch.queue_declare(name, **kw)
    assert conn.is_open, "a channel error leaves the connection open"
    return e.value.reply_code, e.value.reply_text


def test_quorum_declare_rules_as_rabbitmq_3_10(conn):
    q = unique("qq")
    rs = f"queue '{q}' in vhost '/'"
    assert refused(conn, q, arguments=QUORUM) == (
        406,
        f"PRECONDITION_FAILED - invalid property 'non-durable' for {rs}",
    )
    assert refused(conn, q, durable=True, exclusive=True, arguments=QUORUM) == (
        406,
        f"PRECONDITION_FAILED - invalid property 'exclusive-owner' for {rs}",
    )
    assert refused(conn, q, durable=True, auto_delete=True, arguments=QUORUM) == (
        406,
        f"PRECONDITION_FAILED - invalid property 'auto-delete' for {rs}",
    )
    assert refused(conn, "", durable=True, arguments=QUORUM) == (
        406,
        "PRECONDITION_FAILED - Cannot declare a server-named queue for type rabbit_quorum_queue",
    )
    for arg, value in [("x-max-priority", 5), ("x-queue-mode", "lazy")]:
        # Checked before the properties, as RabbitMQ does (this declare is not durable).
        assert refused(conn, q, arguments={**QUORUM, arg: value}) == (
            406,
            f"PRECONDITION_FAILED - invalid arg '{arg}' for {rs} of queue type rabbit_quorum_queue",
        )
    assert refused(conn, q, durable=True, arguments={**QUORUM, "x-dead-letter-strategy": "x"}) == (
        406,
        f"PRECONDITION_FAILED - invalid arg 'x-dead-letter-strategy' for {rs}: invalid_dlx_strategy",
    )
    assert refused(
        conn, q, durable=True, arguments={**QUORUM, "x-quorum-initial-group-size": 0}
    ) == (
        406,
        f"PRECONDITION_FAILED - invalid arg 'x-quorum-initial-group-size' for {rs}: {{value_zero,0}}",
    )
    ch = conn.channel()
    args = {
        **QUORUM,
        "x-quorum-initial-group-size": 1,
        "x-delivery-limit": 3,
        "x-message-ttl": 60000,
        "x-dead-letter-strategy": "at-most-once",
    }
    ok = ch.queue_declare(q, durable=True, arguments=args)
    assert ok.method.message_count == 0
    assert ch.queue_declare(q, durable=True, arguments=args).method.queue == q
    assert ch.queue_declare(q, passive=True).method.queue == q
    # Redeclares must name the same type and limits.
    code, text = refused(conn, q, durable=True, arguments={**args, "x-queue-type": "classic"})
    assert code == 406 and "inequivalent arg 'x-queue-type'" in text, text
    code, text = refused(conn, q, durable=True, arguments={**args, "x-delivery-limit": 4})
    assert code == 406 and "inequivalent arg 'x-delivery-limit'" in text, text
    ch.queue_delete(q)


def test_quorum_poison_message_is_dead_lettered_after_the_delivery_limit(conn):
    ch = conn.channel()
    ch.confirm_delivery()
    dlx, dlq, q = unique("dlx"), unique("dlq"), unique("poison")
    ch.exchange_declare(dlx, exchange_type="fanout")
    ch.queue_declare(dlq)
    ch.queue_bind(dlq, dlx)
    ch.queue_declare(
        q,
        durable=True,
        arguments={**QUORUM, "x-delivery-limit": 2, "x-dead-letter-exchange": dlx},
    )
    # Transient: a quorum queue stores it anyway, and the confirm says so.
    ch.basic_publish("", q, b"poison", pika.BasicProperties(delivery_mode=1))
    ch.basic_qos(prefetch_count=1)
    seen = []
    for method, props, body in ch.consume(q, inactivity_timeout=2):
        if method is None:
            break
        seen.append((body, method.redelivered, (props.headers or {}).get("x-delivery-count")))
        ch.basic_nack(method.delivery_tag, requeue=True)
        if len(seen) > 5:
            break
    ch.cancel()
    # Three deliveries, the redeliveries counted 1 and 2 (none on the first, as RabbitMQ
    # 3.10 sends it); the third return took it over the limit of 2.
    assert seen == [(b"poison", False, None), (b"poison", True, 1), (b"poison", True, 2)]
    deadline = time.monotonic() + 5
    while True:
        method, props, body = ch.basic_get(dlq, auto_ack=True)
        if method is not None or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert body == b"poison"
    death = props.headers["x-death"][0]
    assert death["reason"] == "delivery_limit"
    assert death["queue"] == q and death["count"] == 1
    assert props.headers["x-first-death-reason"] == "delivery_limit"
    assert "x-delivery-count" not in props.headers
    assert ch.queue_declare(q, passive=True).method.message_count == 0


def test_quorum_get_counts_returns_and_returns_go_to_the_tail(conn):
    ch = conn.channel()
    ch.confirm_delivery()
    q = unique("qq")
    ch.queue_declare(q, durable=True, arguments=QUORUM)
    for body in [b"1", b"2", b"3", b"4"]:
        ch.basic_publish("", q, body)
    first = ch.basic_get(q)
    second = ch.basic_get(q)
    # basic.get always carries the count, 0 before any return.
    assert first[1].headers["x-delivery-count"] == 0
    ch.basic_nack(second[0].delivery_tag, requeue=True)
    ch.basic_nack(first[0].delivery_tag, requeue=True)
    got = []
    for _ in range(4):
        method, props, body = ch.basic_get(q)
        got.append((body, method.redelivered, props.headers["x-delivery-count"]))
        ch.basic_ack(method.delivery_tag)
    # Without a delivery limit, returned messages go to the tail in the order they came
    # back (RabbitMQ 3.10; with a limit it serves them first, Warren keeps the tail).
    assert got == [(b"3", False, 0), (b"4", False, 0), (b"2", True, 1), (b"1", True, 1)]
    assert ch.queue_declare(q, passive=True).method.message_count == 0
    ch.queue_delete(q)


def test_quorum_length_limit_consumer_priorities_and_purge(conn):
    ch = conn.channel()
    ch.confirm_delivery()
    q = unique("qq")
    ch.queue_declare(
        q, durable=True, arguments={**QUORUM, "x-max-length": 2, "x-overflow": "reject-publish"}
    )
    nacked = 0
    for body in [b"a", b"b", b"c", b"d"]:
        try:
            ch.basic_publish("", q, body)
        except pika.exceptions.NackError:
            nacked += 1
    # RabbitMQ's quorum queues may take one message past the limit before they refuse
    # (the limit is applied after the fact); Warren refuses at the limit.
    assert nacked >= 1
    assert ch.queue_purge(q).method.message_count in (2, 3)
    low, high = [], []
    ch.basic_qos(prefetch_count=10)
    ch.basic_consume(q, lambda c, m, p, b: low.append(b), auto_ack=True, arguments={"x-priority": 1})
    ch.basic_consume(q, lambda c, m, p, b: high.append(b), auto_ack=True, arguments={"x-priority": 9})
    ch.basic_publish("", q, b"x")
    ch.basic_publish("", q, b"y")
    deadline = time.monotonic() + 5
    while len(low) + len(high) < 2 and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.05)
    assert (high, low) == ([b"x", b"y"], [])


def test_quorum_refuses_a_consumer_under_global_qos(conn):
    ch = conn.channel()
    q = unique("qq")
    ch.queue_declare(q, durable=True, arguments=QUORUM)
    ch.basic_qos(prefetch_count=10, global_qos=True)
    with within("connection.close 540 for global qos on a quorum queue"):
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as closed:
            ch.basic_consume(q, lambda *a: None)
    # RabbitMQ 3.10 closes the connection: a quorum queue keeps no channel-wide prefetch.
    assert closed.value.reply_code == 540
    assert closed.value.reply_text == (
        f"NOT_IMPLEMENTED - queue '{q}' in vhost '/' does not support global qos"
    )
    params = pika.ConnectionParameters(host=HOST, port=int(PORT), socket_timeout=10)
    with pika.BlockingConnection(params) as other:
        other.channel().queue_delete(q)
