"""The migration case of issue 38 against a real RabbitMQ (Debian's 3.10, installed by
scripts/test.sh): a dynamic shovel on Warren with `src-delete-after: queue-length` drains a
queue of a running RabbitMQ while a producer keeps publishing to it; every message RabbitMQ
confirmed ends up exactly once, either moved into Warren or still on RabbitMQ, and the shovel
ends itself. Then the reverse: Warren's queue into RabbitMQ.

Each test run starts its own RabbitMQ node (own name, data dir and side ports: a RabbitMQ of
the machine may hold 5672, 15672, 25672) and its own `warren serve` (WARREN_BIN).
"""
import json
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pika
import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("WARREN_BIN", str(ROOT / "target" / "debug" / "warren"))
N = 3000


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Rabbit:
    """A RabbitMQ node on free loopback ports in a scratch dir (as the `rabbitmq` user when
    run as root: the server script switches to it)."""

    def __init__(self, tmp):
        server = shutil.which("rabbitmq-server")
        assert server, "rabbitmq-server is not installed (scripts/test.sh installs it)"
        self.port, dist = free_port(), free_port()
        # Not under pytest's tmp_path: its folders are 0700, closed to the rabbitmq user.
        self.dir = Path(tempfile.mkdtemp(prefix="warren-test-rabbitmq-"))
        (self.dir / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.port}\nloopback_users = none\n")
        (self.dir / "enabled_plugins").write_text("[].\n")
        self.env = {
            **os.environ, "HOME": str(self.dir),
            "RABBITMQ_NODENAME": f"warren-test-{os.getpid()}@localhost",
            "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbitmq"),
            "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.dir / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
            "RABBITMQ_FEATURE_FLAGS_FILE": str(self.dir / "feature_flags"),
            "RABBITMQ_DIST_PORT": str(dist),
        }
        if os.getuid() == 0:
            rabbit = pwd.getpwnam("rabbitmq")
            for p in [self.dir, *self.dir.rglob("*")]:
                os.chown(p, rabbit.pw_uid, rabbit.pw_gid)
        self.proc = subprocess.Popen([server], env=self.env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 90
        while True:
            try:
                pika.BlockingConnection(self.params()).close()
                return
            except Exception:  # noqa: BLE001 - not up yet
                assert self.proc.poll() is None, f"rabbitmq-server exited: see {self.dir}/log"
                assert time.monotonic() < deadline, "RabbitMQ did not start within 90 s"
                time.sleep(0.5)

    def params(self):
        return pika.ConnectionParameters("127.0.0.1", self.port, socket_timeout=10,
                                         blocked_connection_timeout=30)

    def stop(self):
        subprocess.run(["rabbitmqctl", "stop"], env=self.env, capture_output=True, timeout=60)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class Warren:
    """`warren serve` with AMQP on a free port; every other listener off."""

    def __init__(self, tmp):
        assert Path(BIN).exists(), f"no warren binary at {BIN} (cargo build -p warren-cli)"
        self.data = tmp / f"warren-{uuid.uuid4().hex[:6]}"
        self.proc = subprocess.Popen(
            [BIN, "serve", "--data-dir", str(self.data), "--amqp", "127.0.0.1:0", "--mqtt",
             "none", "--stream", "none", "--management", "none", "--prometheus", "none"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**{k: v for k, v in os.environ.items() if not k.startswith("WARREN_")},
                 "RUST_LOG": "info"})
        self.logs, self.port = [], None
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.logs.append(line)
                if self.port is None and "listening on " in line and "(AMQP" in line:
                    addr = line.split("listening on ")[1].split(" ")[0]
                    self.port = int(addr.rsplit(":", 1)[1])
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        assert ready.wait(20) and self.port, "".join(self.logs)

    def params(self):
        return pika.ConnectionParameters("127.0.0.1", self.port, socket_timeout=10)

    def ctl(self, *args):
        out = subprocess.run([BIN, "ctl", "--data-dir", str(self.data), *args],
                             capture_output=True, text=True, timeout=20)
        assert out.returncode == 0, out.stderr
        return out.stdout

    def shovel_done(self, name, within=90):
        """Waits until the shovel `name` ended itself (`src-delete-after`: its parameter
        is removed, as RabbitMQ does)."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            params = json.loads(self.ctl("--format", "json", "list-parameters"))
            if not any(p.get("name") == name for p in params):
                return
            time.sleep(0.2)
        raise AssertionError(f"shovel {name} still there after {within} s: "
                             f"{self.ctl('shovel-status')}")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(15)


@pytest.fixture
def brokers(tmp_path):
    rabbit = Rabbit(tmp_path)
    warren = None
    try:
        warren = Warren(tmp_path)
        yield rabbit, warren
    finally:
        if warren:
            warren.stop()
        rabbit.stop()


def fill(params, queue, bodies):
    c = pika.BlockingConnection(params)
    ch = c.channel()
    ch.queue_declare(queue, durable=True)
    ch.confirm_delivery()
    for b in bodies:
        ch.basic_publish("", queue, b.encode(), pika.BasicProperties(delivery_mode=2))
    c.close()


def drain(params, queue):
    c = pika.BlockingConnection(params)
    ch = c.channel()
    out = []
    while True:
        method, _props, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            break
        out.append(body.decode())
    c.close()
    return out


def test_a_shovel_drains_a_running_rabbitmq_queue_into_warren_and_back(brokers):
    rabbit, warren = brokers
    old = [f"old-{i}" for i in range(N)]
    fill(rabbit.params(), "legacy", old)
    # A producer keeps publishing to RabbitMQ (confirmed, one by one) during the move.
    late, stop = [], threading.Event()

    def producer():
        c = pika.BlockingConnection(rabbit.params())
        ch = c.channel()
        ch.confirm_delivery()
        i = 0
        while not stop.is_set() and i < 50_000:
            body = f"late-{i}"
            ch.basic_publish("", "legacy", body.encode(), pika.BasicProperties(delivery_mode=2))
            late.append(body)  # confirmed: basic_publish returned
            i += 1
        c.close()

    t = threading.Thread(target=producer)
    t.start()
    value = {"src-uri": f"amqp://guest:guest@127.0.0.1:{rabbit.port}", "src-queue": "legacy",
             "dest-uri": "amqp://", "dest-queue": "legacy", "src-delete-after": "queue-length"}
    try:
        warren.ctl("set-parameter", "shovel", "migrate", json.dumps(value))
        warren.shovel_done("migrate")
    finally:
        stop.set()
        t.join(30)
    moved = drain(warren.params(), "legacy")
    left = drain(rabbit.params(), "legacy")
    assert len(moved) == len(set(moved)), "a message moved twice"
    assert set(old) <= set(moved), "every message queued before the shovel started moved"
    # Exactly once across both brokers: nothing lost, nothing invented, nothing doubled.
    assert sorted(moved + left) == sorted(old + late)
    assert late, "the producer published during the move"

    # The reverse: Warren's queue into RabbitMQ.
    out = [f"w-{i}" for i in range(N)]
    fill(warren.params(), "outbound", out)
    value = {"src-uri": "amqp://", "src-queue": "outbound",
             "dest-uri": f"amqp://guest:guest@127.0.0.1:{rabbit.port}",
             "dest-queue": "inbound", "src-delete-after": "queue-length"}
    warren.ctl("set-parameter", "shovel", "back", json.dumps(value))
    warren.shovel_done("back")
    got = drain(rabbit.params(), "inbound")
    assert sorted(got) == sorted(out)
    assert drain(warren.params(), "outbound") == []
