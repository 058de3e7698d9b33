"""pika (Python's reference AMQP 0.9.1 client) against a running `warren serve`.

Broker address from WARREN_AMQP (host:port), default 127.0.0.1:5672.
"""
import os
import uuid

import pika
import pytest

from conftest import within

HOST, PORT = os.environ.get("WARREN_AMQP", "127.0.0.1:5672").rsplit(":", 1)


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


def test_declare_bind_publish_consume_ack(conn):
    ch = conn.channel()
    ex, q = unique("ex"), unique("q")
    ch.exchange_declare(ex, exchange_type="topic")
    declared = ch.queue_declare(q)
    assert declared.method.queue == q
    assert declared.method.message_count == 0
    ch.queue_bind(q, ex, routing_key="logs.*")
    for i in range(10):
        ch.basic_publish(ex, f"logs.{i}", f"m{i}".encode())
    ch.basic_publish(ex, "other.key", b"unrouted")
    received = []
    for method, props, body in ch.consume(q, inactivity_timeout=5):
        assert method is not None, "timed out waiting for messages"
        received.append(body.decode())
        ch.basic_ack(method.delivery_tag)
        if len(received) == 10:
            break
    ch.cancel()
    assert received == [f"m{i}" for i in range(10)]
    assert ch.queue_declare(q, passive=True).method.message_count == 0


def test_mandatory_unroutable_message_is_returned(conn):
    ch = conn.channel()
    returned = []
    ch.add_on_return_callback(lambda _ch, method, props, body: returned.append((method, body)))
    ch.basic_publish("amq.direct", unique("nobody"), b"lost?", mandatory=True)
    conn.process_data_events(time_limit=1)
    assert len(returned) == 1
    method, body = returned[0]
    assert method.reply_code == 312
    assert method.reply_text == "NO_ROUTE"
    assert body == b"lost?"


def test_publisher_confirms(conn):
    ch = conn.channel()
    ch.confirm_delivery()
    q = unique("confirmed")
    ch.queue_declare(q)
    for i in range(50):
        # BlockingChannel raises on nack or, with mandatory, on return; success means acked.
        ch.basic_publish("", q, str(i).encode(), mandatory=True)
    assert ch.queue_declare(q, passive=True).method.message_count == 50
    with pytest.raises(pika.exceptions.UnroutableError):
        ch.basic_publish("", unique("missing"), b"x", mandatory=True)


def test_passive_declare_of_missing_queue_closes_only_that_channel(conn):
    ok = conn.channel()
    bad = conn.channel()
    with within("channel.close 404 for a passive declare of a missing queue"):
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
            bad.queue_declare(unique("missing"), passive=True)
    assert err.value.reply_code == 404
    assert "NOT_FOUND" in err.value.reply_text
    assert bad.is_closed
    assert conn.is_open
    q = unique("still-fine")
    ok.queue_declare(q)
    ok.basic_publish("", q, b"alive")
    method, _props, body = ok.basic_get(q, auto_ack=True)
    assert body == b"alive"


def test_closes_that_cross_leave_the_connection_open(conn):
    # The client closes a channel while the broker's channel.close for an error on it is on
    # the wire, so each side gets the other's close and answers it. The broker must still
    # take the client's close-ok after answering its close (RabbitMQ does); it used to forget
    # the channel and close the connection with 504 at that close-ok. Found by amqp091-go's
    # TestChannelExceptionWithCloseIssue43; the rounds make the crossing near certain.
    other = conn.channel()
    for round in range(20):
        bad = conn.channel()
        bad.basic_publish(unique("no-such-exchange"), "", b"lost")
        # The wait CI once hung in: a close-ok the broker never sent (dd46470).
        with within(f"channel.close-ok for the client's close crossing the broker's (round {round})"):
            try:
                bad.close()
            except pika.exceptions.ChannelClosed:
                pass
        assert conn.is_open, f"round {round}"
        with within(f"exchange.declare-ok on the other channel (round {round})"):
            other.exchange_declare("amq.direct", passive=True)
    assert conn.is_open


def test_basic_get_and_reject_requeue_marks_redelivered(conn):
    ch = conn.channel()
    q = unique("get")
    ch.queue_declare(q)
    ch.basic_publish("", q, b"once")
    method, _props, body = ch.basic_get(q)
    assert body == b"once" and not method.redelivered
    ch.basic_reject(method.delivery_tag, requeue=True)
    method, _props, body = ch.basic_get(q)
    assert body == b"once" and method.redelivered
    ch.basic_ack(method.delivery_tag)
    assert ch.basic_get(q) == (None, None, None)


def test_tutorial_2_work_queue_fair_dispatch_with_persistent_messages(conn):
    """Durable queue, persistent messages, prefetch 1: each worker holds one task at a time."""
    ch = conn.channel()
    q = unique("task_queue")
    ch.queue_declare(q, durable=True)
    for i in range(4):
        ch.basic_publish(
            "", q, f"task{i}".encode(), pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent)
        )
    worker_a, worker_b = conn.channel(), conn.channel()
    for w in (worker_a, worker_b):
        w.basic_qos(prefetch_count=1)
    got = {"a": [], "b": []}
    worker_a.basic_consume(q, lambda c, m, p, b: got["a"].append((m.delivery_tag, b)))
    worker_b.basic_consume(q, lambda c, m, p, b: got["b"].append((m.delivery_tag, b)))
    conn.process_data_events(time_limit=0.5)
    # Nothing acked yet: each worker holds exactly one task.
    assert len(got["a"]) == 1 and len(got["b"]) == 1
    worker_a.basic_ack(got["a"][0][0])
    conn.process_data_events(time_limit=0.5)
    assert len(got["a"]) == 2 and len(got["b"]) == 1
    assert sorted(b for _, b in got["a"] + got["b"]) == [b"task0", b"task1", b"task2"]


def test_tutorial_6_rpc_with_reply_to_and_correlation_id(conn):
    server = conn.channel()
    rpc_queue = server.queue_declare("", exclusive=True).method.queue  # server-named

    def on_request(ch, method, props, body):
        reply = str(int(body) * 2).encode()
        ch.basic_publish(
            "", props.reply_to, reply, pika.BasicProperties(correlation_id=props.correlation_id)
        )
        ch.basic_ack(method.delivery_tag)

    server.basic_consume(rpc_queue, on_request)
    client = conn.channel()
    callback_queue = client.queue_declare("", exclusive=True).method.queue
    responses = {}
    client.basic_consume(
        callback_queue,
        lambda ch, m, p, b: responses.__setitem__(p.correlation_id, b),
        auto_ack=True,
    )
    corr = str(uuid.uuid4())
    client.basic_publish(
        "", rpc_queue, b"21", pika.BasicProperties(reply_to=callback_queue, correlation_id=corr)
    )
    deadline = 50
    while corr not in responses and deadline:
        conn.process_data_events(time_limit=0.1)
        deadline -= 1
    assert responses.get(corr) == b"42"


def wait_get(ch, queue, attempts=100):
    """basic.get until a message arrives (bounded: 100 x 20 ms)."""
    import time

    for _ in range(attempts):
        method, props, body = ch.basic_get(queue, auto_ack=True)
        if method is not None:
            return method, props, body
        time.sleep(0.02)
    raise AssertionError(f"nothing arrived in {queue}")


def test_ttl_and_dead_lettering_with_x_death(conn):
    ch = conn.channel()
    dlx, dlq, q = unique("dlx"), unique("dlq"), unique("ttl")
    ch.exchange_declare(dlx, exchange_type="fanout")
    ch.queue_declare(dlq)
    ch.queue_bind(dlq, dlx)
    ch.queue_declare(q, arguments={"x-message-ttl": 30, "x-dead-letter-exchange": dlx})
    ch.basic_publish("", q, b"expiring", pika.BasicProperties(headers={"app": "x"}))
    method, props, body = wait_get(ch, dlq)
    assert body == b"expiring"
    assert method.exchange == dlx and method.routing_key == q
    death = props.headers["x-death"][0]
    assert death["reason"] == "expired"
    assert death["queue"] == q
    assert death["count"] == 1
    assert death["routing-keys"] == [q]
    assert props.headers["x-first-death-reason"] == "expired"
    assert props.headers["app"] == "x"


def test_max_length_and_persistent_messages_on_durable_queues(conn):
    ch = conn.channel()
    ch.confirm_delivery()
    q = unique("durable")
    ch.queue_declare(q, durable=True, arguments={"x-max-length": 3})
    for i in range(5):
        ch.basic_publish("", q, f"m{i}".encode(), pika.BasicProperties(delivery_mode=2))
    assert ch.queue_declare(q, passive=True).method.message_count == 3
    got = []
    for _ in range(10):  # bounded: a queue that never empties fails the assert below
        method, _, body = ch.basic_get(q, auto_ack=True)
        if method is None:
            break
        got.append(body)
    assert got == [b"m2", b"m3", b"m4"]
    ch.queue_delete(q)


def test_direct_reply_to_rpc(conn):
    server = conn.channel()
    rpc = unique("rpc")
    server.queue_declare(rpc)
    client = conn.channel()
    replies = []
    client.basic_consume(
        "amq.rabbitmq.reply-to",
        lambda ch, method, props, body: replies.append(body),
        auto_ack=True,
    )
    client.basic_publish(
        "", rpc, b"ping", pika.BasicProperties(reply_to="amq.rabbitmq.reply-to")
    )
    method, props, body = wait_get(server, rpc)
    assert body == b"ping"
    assert props.reply_to.startswith("amq.rabbitmq.reply-to.")
    server.basic_publish("", props.reply_to, b"pong")
    conn.process_data_events(time_limit=1)
    for _ in range(50):
        if replies:
            break
        conn.process_data_events(time_limit=0.1)
    assert replies == [b"pong"]


def ctl(*args):
    """Runs `warren ctl` against the broker under test (WARREN_CTL)."""
    import shlex
    import subprocess

    command = os.environ.get("WARREN_CTL")
    if not command:
        pytest.skip("WARREN_CTL (the warren ctl command for this broker) is not set")
    subprocess.run(shlex.split(command) + list(args), check=True, timeout=30)


def test_users_vhosts_and_permission_refusals():
    vhost, user = unique("vh"), unique("user")
    ctl("add-vhost", vhost)
    ctl("add-user", user, "s3cret")
    ctl("-p", vhost, "set-permissions", user, f"^{user}-.*", ".*", ".*")

    def connect(password, vh=vhost):
        return pika.BlockingConnection(
            pika.ConnectionParameters(
                host=HOST,
                port=int(PORT),
                virtual_host=vh,
                credentials=pika.PlainCredentials(user, password),
                socket_timeout=10,
            )
        )

    with within("the refusal of a wrong password"):
        with pytest.raises(pika.exceptions.ProbableAuthenticationError):
            connect("wrong")
    # pika reports a connection.close during connection.open as a probable access denial.
    with within("connection.close 530 for a vhost without permissions"):
        with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as refused:
            connect("s3cret", vh="/")
    assert "(530)" in str(refused.value)
    assert f"access to vhost '/' refused for user '{user}'" in str(refused.value)
    with within("connection.open-ok"):
        c = connect("s3cret")
    try:
        ch = c.channel()
        ch.queue_declare(f"{user}-work")
        with within("channel.close 403 for a declare without permission"):
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as denied:
                ch.queue_declare("someone-else")
        assert denied.value.reply_code == 403
        assert denied.value.reply_text == (
            f"ACCESS_REFUSED - access to queue 'someone-else' in vhost '{vhost}' "
            f"refused for user '{user}'"
        )
        ch = c.channel()
        ch.basic_publish("", f"{user}-work", b"in the vhost")
        method, _, body = ch.basic_get(f"{user}-work", auto_ack=True)
        assert body == b"in the vhost"
    finally:
        with within("connection.close-ok"):
            c.close()
    ctl("delete-user", user)
    ctl("delete-vhost", vhost)


def test_update_secret_keeps_the_connection_and_queue_types_are_checked(conn):
    # connection.update-secret (RabbitMQ 3.8+): the new secret is guest's password, so the
    # broker answers update-secret-ok and the connection carries on.
    with within("connection.update-secret-ok"):
        conn.update_secret("guest", "token refresh")
    # Nor is any other secret checked as guest's password: RabbitMQ 3.10's internal users'
    # credentials do not expire and it takes whatever comes (pika's own TestUpdateSecret).
    with within("connection.update-secret-ok"):
        conn.update_secret("new_secret", "token refresh")
    ch = conn.channel()
    q = unique("q")
    ch.queue_declare(q, arguments={"x-queue-type": "classic"})
    with within("channel.close 406 for an unsupported queue type"):
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            ch.queue_declare(unique("q"), arguments={"x-queue-type": "bogus"})
    assert refused.value.reply_code == 406
    assert "unsupported queue type 'bogus'" in refused.value.reply_text
    assert conn.is_open
    caps = conn._impl.server_capabilities
    assert caps.get("consumer_priorities") and caps.get("direct_reply_to")
