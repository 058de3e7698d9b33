"""RabbitMQ's own AMQP 1.0 client (rabbitmq-amqp-python-client, on python-qpid-proton)
against a running `warren serve`: it checks the server is "RabbitMQ" >= 4.0.0, then declares,
binds, purges and deletes through the management node (`/management`, HTTP over AMQP) and
publishes and consumes over RabbitMQ 4's v2 addresses.

Broker address from WARREN_AMQP (host:port), default 127.0.0.1:5672: the AMQP port serves
0.9.1 and 1.0, the protocol header decides.
"""
import os
import uuid

import pytest

from conftest import within
from rabbitmq_amqp_python_client import (
    AddressHelper,
    AMQPMessagingHandler,
    ClassicQueueSpecification,
    Converter,
    Environment,
    Event,
    ExchangeCustomSpecification,
    ExchangeSpecification,
    ExchangeToExchangeBindingSpecification,
    ExchangeToQueueBindingSpecification,
    ExchangeType,
    Message,
    OutcomeState,
    QueueType,
    QuorumQueueSpecification,
    StreamSpecification,
    ValidationCodeException,
)

HOST, PORT = os.environ.get("WARREN_AMQP", "127.0.0.1:5672").rsplit(":", 1)
URI = f"amqp://guest:guest@{HOST}:{PORT}/"


def unique(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def connection():
    environment = Environment(uri=URI)
    with within("AMQP 1.0 open (the client's server-properties check)"):
        conn = environment.connection()
        conn.dial()
    yield conn
    with within("AMQP 1.0 close"):
        environment.close()


class Done(Exception):
    """Ends `Consumer.run()` (the client's own tests stop their consumers so)."""


class Collect(AMQPMessagingHandler):
    def __init__(self, count):
        super().__init__()
        self.count = count
        self.bodies = []

    def on_amqp_message(self, event: Event):
        self.delivery_context.accept(event)
        self.bodies.append(Converter.bytes_to_string(event.message.body))
        if len(self.bodies) == self.count:
            raise Done()


def consume(connection, queue, count):
    handler = Collect(count)
    consumer = None
    with within(f"{count} deliveries from {queue}", 30):
        try:
            # Deliveries may all come while the link is being attached.
            consumer = connection.consumer(AddressHelper.queue_address(queue), message_handler=handler)
            consumer.run()
        except Done:
            pass
    if consumer is not None:
        consumer.close()
    return handler.bodies


def publish(connection, address, bodies):
    publisher = connection.publisher(address)
    outcomes = []
    with within(f"settlement of {len(bodies)} publishes to {address}", 30):
        for b in bodies:
            status = publisher.publish(Message(body=Converter.string_to_bytes(b)))
            outcomes.append(status.remote_state)
    publisher.close()
    return outcomes


def test_server_is_accepted_and_management_node_answers(connection):
    management = connection.management()
    q = unique("q")
    with within("queue declare"):
        management.declare_queue(ClassicQueueSpecification(name=q, is_durable=False))
    info = management.queue_info(q)
    assert info.name == q
    assert info.queue_type == QueueType.classic
    assert info.is_durable is False and info.is_exclusive is False
    assert info.message_count == 0 and info.consumer_count == 0
    # `replicas` is an AMQP array of strings, as RabbitMQ sends it.
    assert info.leader and list(info.members.elements) == [info.leader]
    # A second declare with the same properties is fine (RabbitMQ's 200).
    management.declare_queue(ClassicQueueSpecification(name=q, is_durable=False))
    management.delete_queue(q)
    with pytest.raises(ValidationCodeException, match="404"):
        management.queue_info(q)


def test_declare_bind_publish_consume_purge_delete(connection):
    management = connection.management()
    ex, q, key = unique("ex"), unique("q"), "logs.info"
    management.declare_exchange(ExchangeSpecification(name=ex, exchange_type=ExchangeType.topic))
    management.declare_queue(QuorumQueueSpecification(name=q))
    binding = management.bind(
        ExchangeToQueueBindingSpecification(source_exchange=ex, destination_queue=q, binding_key="logs.*")
    )
    outcomes = publish(connection, AddressHelper.exchange_address(ex, key), [f"m{i}" for i in range(20)])
    assert outcomes == [OutcomeState.ACCEPTED] * 20
    info = management.queue_info(q)
    assert info.queue_type == QueueType.quorum
    assert info.message_count == 20
    assert consume(connection, q, 10) == [f"m{i}" for i in range(10)]
    # The other ten are still there: purge says so, and leaves none.
    assert management.purge_queue(q) == 10
    assert management.queue_info(q).message_count == 0

    management.unbind(binding)
    publish(connection, AddressHelper.exchange_address(ex, key), ["after unbind"])
    assert management.queue_info(q).message_count == 0, "unbound: nothing routed"

    management.delete_queue(q)
    management.delete_exchange(ex)
    with pytest.raises(ValidationCodeException, match="404"):
        management.purge_queue(q)


def test_publish_to_queue_address_and_exchange_to_exchange_binding(connection):
    management = connection.management()
    src, dst, q = unique("src"), unique("dst"), unique("q")
    management.declare_exchange(ExchangeSpecification(name=src, exchange_type=ExchangeType.fanout))
    management.declare_exchange(ExchangeSpecification(name=dst, exchange_type=ExchangeType.direct))
    management.declare_queue(ClassicQueueSpecification(name=q))
    management.bind(ExchangeToExchangeBindingSpecification(source_exchange=src, destination_exchange=dst))
    management.bind(ExchangeToQueueBindingSpecification(source_exchange=dst, destination_queue=q, binding_key=""))
    publish(connection, AddressHelper.exchange_address(src), ["via two exchanges"])
    publish(connection, AddressHelper.queue_address(q), ["straight to the queue"])
    assert consume(connection, q, 2) == ["via two exchanges", "straight to the queue"]
    management.delete_queue(q)
    management.delete_exchange(dst)
    management.delete_exchange(src)


def test_stream_declare_and_info(connection):
    management = connection.management()
    s = unique("stream")
    management.declare_queue(StreamSpecification(name=s, max_len_bytes=10_000_000))
    info = management.queue_info(s)
    assert info.queue_type == QueueType.stream
    assert info.is_durable is True
    assert info.arguments.get("x-max-length-bytes") == 10_000_000
    management.delete_queue(s)


def test_errors_are_rabbitmq_status_codes(connection):
    management = connection.management()
    q = unique("q")
    management.declare_queue(QuorumQueueSpecification(name=q))
    # Redeclaring as another type is PRECONDITION_FAILED: 409, which the client names.
    with pytest.raises(ValidationCodeException, match="ErrPreconditionFailed"):
        management.declare_queue(ClassicQueueSpecification(name=q))
    # The pair goes on after the error (its core channel is reopened).
    assert management.queue_info(q).queue_type == QueueType.quorum
    with pytest.raises(ValidationCodeException, match="404"):
        management.queue_info(unique("missing"))
    with pytest.raises(ValidationCodeException, match="403"):
        management.declare_queue(ClassicQueueSpecification(name="amq." + q))
    with pytest.raises(ValidationCodeException, match="400"):
        management.declare_exchange(ExchangeCustomSpecification(name=unique("ex"), exchange_type="no-such-type"))
    # Paths and methods the node does not serve: their status codes, the pair still usable.
    resp = management.request(None, "/no-such-thing", "GET", [404])
    assert int(resp.subject) == 404
    resp = management.request(None, "/queues/" + q, "PATCH", [405])
    assert int(resp.subject) == 405
    # Deleting what is gone is RabbitMQ's 200 / 204, not an error.
    management.delete_queue(q)
    management.delete_queue(q)
    management.delete_exchange(unique("never-declared"))


def test_consume_from_missing_queue_is_refused(connection):
    # Refused at the attach, as RabbitMQ does: the client raises while creating the consumer.
    with pytest.raises(Exception) as refused:
        with within("refusal of a link to a missing queue", 10):
            consume(connection, unique("missing"), 1)
    assert not isinstance(refused.value, TimeoutError)
    assert "not-found" in str(refused.value) or "NOT_FOUND" in str(refused.value), refused.value
    # (The client then closes its own connection, as it does against RabbitMQ.)


def test_missing_vhost_fails_the_connect():
    # As RabbitMQ: the handshake ends before any open, so dial() itself raises (an open
    # followed by a close would let it return and start the client's reconnection).
    from rabbitmq_amqp_python_client.qpid.proton._exceptions import ConnectionException

    environment = Environment(uri=f"amqp://guest:guest@{HOST}:{PORT}/{unique('no-such-vhost')}")
    with pytest.raises(ConnectionException):
        with within("refusal of a missing vhost", 10):
            environment.connection().dial()
