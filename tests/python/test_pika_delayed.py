"""Delayed delivery with pika (docs/delayed.md): the rabbitmq_delayed_message_exchange
plugin's interface as Python apps use it, through a `kill -9` with schedules pending.

Starts its own `warren serve` on a data directory (the binary from WARREN_BIN), kills it
with SIGKILL once every schedule is confirmed, starts it again on the same directory.
"""
import os
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pika
import pytest

from conftest import within

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("WARREN_BIN", str(ROOT / "target" / "debug" / "warren"))


class Broker:
    """`warren serve` on `data` with AMQP on a free port, every other listener off."""

    def __init__(self, data):
        assert Path(BIN).exists(), f"no warren binary at {BIN} (cargo build -p warren-cli)"
        self.proc = subprocess.Popen(
            [BIN, "serve", "--data-dir", str(data), "--amqp", "127.0.0.1:0", "--mqtt", "none",
             "--stream", "none", "--management", "none", "--prometheus", "none"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**{k: v for k, v in os.environ.items() if not k.startswith("WARREN_")},
                 "RUST_LOG": "info"})
        self.logs, self.port = [], None
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.logs.append(line)
                if "listening on 127.0.0.1:" in line and "(AMQP" in line:
                    rest = line.split("listening on 127.0.0.1:")[1]
                    self.port = int(rest.split(" ")[0].strip())
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        assert ready.wait(20) and self.port, "".join(self.logs)

    def connect(self):
        with within("connection.open-ok"):
            return pika.BlockingConnection(pika.ConnectionParameters(
                host="127.0.0.1", port=self.port, socket_timeout=10))

    def kill9(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def data(tmp_path):
    return tmp_path / f"data-{uuid.uuid4().hex[:6]}"


def declare(ch):
    ch.exchange_declare("delayed", exchange_type="x-delayed-message", durable=True,
                        arguments={"x-delayed-type": "direct"})
    ch.queue_declare("q", durable=True)
    ch.queue_bind("q", "delayed", routing_key="k")


def test_pika_schedules_survive_kill_9_in_due_order(data):
    b = Broker(data)
    conn = b.connect()
    ch = conn.channel()
    declare(ch)
    ch.confirm_delivery()
    # 40 with scrambled x-delay, due while the broker is down; 40 with scrambled
    # x-deliver-at (absolute, so their due order is known exactly), due after the restart.
    now_ms = int(time.time() * 1000)
    early = [300 + (i * 37) % 40 * 10 for i in range(40)]
    late = [now_ms + 5000 + (i * 37) % 40 * 20 for i in range(40)]
    for i, d in enumerate(early):
        # A confirmed publish (pika raises on a nack).
        ch.basic_publish("delayed", "k", f"early-{i:02d}".encode(),
                         properties=pika.BasicProperties(delivery_mode=2,
                                                         headers={"x-delay": d}))
    for at in late:
        ch.basic_publish("delayed", "k", f"late-{at}".encode(),
                         properties=pika.BasicProperties(delivery_mode=2,
                                                         headers={"x-deliver-at": at}))
    total = len(early) + len(late)
    b.kill9()
    time.sleep(1.2)
    b = Broker(data)
    conn = b.connect()
    ch = conn.channel()
    got = []
    with within("every delayed message", 30):
        for method, props, body in ch.consume("q", inactivity_timeout=10):
            assert method is not None, f"only {got} arrived"
            if body.startswith(b"early-"):
                # The plugin's mark: routed with the delay negated. pika reads the signed
                # 64-bit 'l' (RabbitMQ's errata, what the plugin sends too) as unsigned.
                delay = props.headers["x-delay"]
                delay = delay - 2**64 if delay >= 2**63 else delay
                assert -700 <= delay <= -300, props.headers
            got.append(body.decode())
            ch.basic_ack(method.delivery_tag)
            if len(got) == total:
                break
    # What fell due while down comes first (at start), then the rest in due order; none lost.
    assert sorted(got[:40]) == sorted(f"early-{i:02d}" for i in range(40)), got
    assert got[40:] == [f"late-{at}" for at in sorted(late)], got[40:]
    b.kill9()


def test_pika_bad_x_delay_is_406_and_the_connection_stays(data):
    b = Broker(data)
    conn = b.connect()
    ch = conn.channel()
    declare(ch)
    ch.confirm_delivery()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
        ch.basic_publish("delayed", "k", b"x",
                         properties=pika.BasicProperties(headers={"x-delay": "soon"}))
    assert e.value.reply_code == 406
    assert conn.is_open
    ch = conn.channel()
    ch.basic_publish("delayed", "k", b"ok", properties=pika.BasicProperties(headers={"x-delay": 50}))
    with within("the delayed message"):
        for method, _props, body in ch.consume("q", inactivity_timeout=5):
            assert method is not None
            assert body == b"ok"
            break
    b.kill9()
