"""TLS with the reference clients: pika with `ssl_options` (with and without a client
certificate, and the EXTERNAL login by the certificate), paho-mqtt over mqtts with a client
certificate (`--mqtt-use-identity-as-username`), and Mosquitto's mosquitto_pub/mosquitto_sub
with `--cafile`, `--cert` and `--key`.

Each test starts its own `warren serve` (the binary from WARREN_BIN, default
target/debug/warren) with certificates this module makes with the `openssl` command line: a
CA, a server certificate for localhost, and client certificates whose subject CN is the user
they log in as. Nothing here is skipped: a missing binary or tool fails the test.
"""
import json
import os
import shutil
import ssl
import subprocess
import threading
import time
import uuid
from pathlib import Path

import paho.mqtt.client as mqtt
import pika
import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("WARREN_BIN", str(ROOT / "target" / "debug" / "warren"))
DEVICE = "device-42"


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def issue(dir, ca, name, cn):
    """A certificate `name`.pem (key `name`.key, PKCS#8) with subject CN `cn`, signed by the
    CA `ca`.pem/`ca`.key, valid for localhost and 127.0.0.1 as server and as client."""
    openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}",
            cwd=dir)
    (dir / f"{name}.ext").write_text(
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n")
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
            cwd=dir)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    dir = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "rogue-ca"):
        openssl("req", "-x509", "-new", "-newkey", "ec", "-pkeyopt",
                "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{ca}.key", "-out",
                f"{ca}.pem", "-days", "2", "-subj", f"/CN=Warren test {ca}", "-addext",
                "basicConstraints=critical,CA:TRUE", "-addext",
                "keyUsage=critical,keyCertSign,cRLSign", cwd=dir)
    issue(dir, "ca", "server", "localhost")
    issue(dir, "ca", "device", DEVICE)
    issue(dir, "ca", "stranger", "nobody-here")
    issue(dir, "rogue-ca", "rogue", DEVICE)
    return dir


class Broker:
    """`warren serve` in memory with AMQPS and MQTTS on free ports, client certificates
    verified against the test CA; `extra` adds flags. Logs are kept for assertions."""

    def __init__(self, pki, tmp, extra=()):
        assert Path(BIN).exists(), f"no warren binary at {BIN} (cargo build -p warren-cli)"
        self.data = tmp / f"data-{uuid.uuid4().hex[:6]}"
        self.proc = subprocess.Popen(
            [BIN, "serve", "--in-memory", "--data-dir", str(self.data), "--amqp", "none",
             "--mqtt", "none", "--stream", "none", "--management", "none", "--prometheus",
             "none", "--amqps", "127.0.0.1:0", "--mqtts", "127.0.0.1:0",
             "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
             "--tls-ca", str(pki / "ca.pem"), "--tls-verify-peer", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            # The broker reads WARREN_* as its configuration; the CI
            # step sets WARREN_AMQP etc. for the tests' shared broker, not for this one.
            env={**{k: v for k, v in os.environ.items() if not k.startswith("WARREN_")},
                 "RUST_LOG": "info"})
        self.logs = []
        self.ports = {}
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.logs.append(line)
                for kind in ("amqps", "mqtts"):
                    marker = f" for {kind}:"
                    if "listening on " in line and marker in line:
                        addr = line.split("listening on ")[1].split(" ")[0]
                        self.ports[kind] = int(addr.rsplit(":", 1)[1])
                if len(self.ports) == 2:
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        assert ready.wait(20) and len(self.ports) == 2, "".join(self.logs)
        self.ctl("add-user", DEVICE, "not-used-by-certificate-logins")
        self.ctl("set-permissions", DEVICE, ".*", ".*", ".*")

    def ctl(self, *args):
        out = subprocess.run([BIN, "ctl", "--data-dir", str(self.data), *args],
                             capture_output=True, text=True, timeout=20)
        assert out.returncode == 0, out.stderr
        return out.stdout

    def connections(self):
        return json.loads(self.ctl("--format", "json", "list-connections"))

    def wait_connection(self, match):
        """The listed connection `match` accepts, polled for up to 10 s."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            found = [c for c in self.connections() if match(c)]
            if found:
                return found[0]
            time.sleep(0.1)
        raise AssertionError(f"no such connection in {self.connections()}")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(15)


@pytest.fixture
def broker(pki, tmp_path):
    b = Broker(pki, tmp_path)
    yield b
    b.stop()


def unique(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def pika_params(pki, port, cert=None, credentials=None):
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if cert:
        ctx.load_cert_chain(str(pki / f"{cert}.pem"), str(pki / f"{cert}.key"))
    return pika.ConnectionParameters(
        host="localhost", port=port, ssl_options=pika.SSLOptions(ctx, "localhost"),
        credentials=credentials or pika.PlainCredentials("guest", "guest"),
        blocked_connection_timeout=10, socket_timeout=10, connection_attempts=1)


def round_trip(conn):
    ch = conn.channel()
    ch.confirm_delivery()
    q = unique("tls")
    ch.queue_declare(q)
    ch.basic_publish("", q, b"over TLS", mandatory=True)
    method, _props, body = ch.basic_get(q, auto_ack=True)
    assert method is not None and body == b"over TLS"


def test_pika_ssl_options_without_client_certificate(pki, broker):
    conn = pika.BlockingConnection(pika_params(pki, broker.ports["amqps"]))
    round_trip(conn)
    c = broker.wait_connection(lambda c: c["protocol"] and "AMQP" in c["protocol"])
    assert (c["user"], c["ssl"]) == ("guest", True)
    conn.close()


def test_pika_client_certificate_and_external_login(pki, broker):
    # The certificate's CN is the user: no password crosses the wire.
    params = pika_params(pki, broker.ports["amqps"], cert="device",
                         credentials=pika.credentials.ExternalCredentials())
    conn = pika.BlockingConnection(params)
    round_trip(conn)
    c = broker.wait_connection(lambda c: c["user"] == DEVICE)
    assert c["ssl"] is True
    conn.close()
    # A certificate of this CA whose CN is no user: EXTERNAL is refused.
    params = pika_params(pki, broker.ports["amqps"], cert="stranger",
                         credentials=pika.credentials.ExternalCredentials())
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        pika.BlockingConnection(params)
    # A certificate of another CA: the handshake fails.
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    ctx.load_cert_chain(str(pki / "rogue.pem"), str(pki / "rogue.key"))
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        pika.BlockingConnection(pika.ConnectionParameters(
            host="localhost", port=broker.ports["amqps"],
            ssl_options=pika.SSLOptions(ctx, "localhost"), connection_attempts=1,
            credentials=pika.credentials.ExternalCredentials(), socket_timeout=10))
    assert any("TLS handshake failed" in line for line in broker.logs), "".join(broker.logs)


def test_pika_without_certificate_is_refused_with_fail_if_no_peer_cert(pki, tmp_path):
    b = Broker(pki, tmp_path, ["--tls-fail-if-no-peer-cert"])
    try:
        with pytest.raises(pika.exceptions.AMQPConnectionError):
            pika.BlockingConnection(pika_params(pki, b.ports["amqps"]))
        conn = pika.BlockingConnection(pika_params(pki, b.ports["amqps"], cert="device"))
        round_trip(conn)
        conn.close()
    finally:
        b.stop()


class Paho:
    def __init__(self, pki, port, client_id, protocol, cert=None, username=None):
        self.messages = []
        self.acked = threading.Event()
        self.connected = threading.Event()
        self.rc = None
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                             protocol=protocol)
        certfile = str(pki / f"{cert}.pem") if cert else None
        keyfile = str(pki / f"{cert}.key") if cert else None
        self.c.tls_set(ca_certs=str(pki / "ca.pem"), certfile=certfile, keyfile=keyfile)
        if username:
            self.c.username_pw_set(username, "guest")

        def on_connect(_c, _u, _flags, rc, _props):
            self.rc = rc
            self.connected.set()

        self.c.on_connect = on_connect
        self.c.on_message = lambda _c, _u, m: self.messages.append((m.topic, m.payload))
        self.c.on_subscribe = lambda *_: self.acked.set()
        self.c.connect("localhost", port, keepalive=30)
        self.c.loop_start()
        assert self.connected.wait(10), "no CONNACK"
        assert not self.rc.is_failure, f"CONNECT refused: {self.rc}"

    def subscribe(self, topic):
        self.c.subscribe(topic, qos=1)
        assert self.acked.wait(10), "no SUBACK"

    def wait(self, count):
        deadline = time.monotonic() + 10
        while len(self.messages) < count and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.messages

    def close(self):
        self.c.disconnect()
        self.c.loop_stop()


@pytest.mark.parametrize("protocol", [mqtt.MQTTv311, mqtt.MQTTv5], ids=["v3.1.1", "v5"])
def test_paho_mqtts_with_client_certificate_logs_in_as_its_cn(pki, tmp_path, protocol):
    b = Broker(pki, tmp_path, ["--mqtt-use-identity-as-username"])
    try:
        topic = unique("tls/devices")
        # No user name in CONNECT: the certificate's CN is the user.
        device = Paho(pki, b.ports["mqtts"], unique("dev"), protocol, cert="device")
        c = b.wait_connection(lambda c: c["client_id"] == device.c._client_id.decode())
        assert (c["user"], c["ssl"]) == (DEVICE, True)
        # A client without a certificate logs in with its own credentials.
        watcher = Paho(pki, b.ports["mqtts"], unique("watch"), protocol, username="guest")
        watcher.subscribe(topic + "/#")
        device.c.publish(topic + "/t", b"21.5", qos=1).wait_for_publish(10)
        assert watcher.wait(1) == [(topic + "/t", b"21.5")]
        device.close()
        watcher.close()
    finally:
        b.stop()


def mosquitto(tool, pki, port, *args, cert="device"):
    assert shutil.which(tool), f"{tool} is not installed (Debian's mosquitto-clients)"
    tls = ["--cafile", str(pki / "ca.pem")]
    if cert:
        tls += ["--cert", str(pki / f"{cert}.pem"), "--key", str(pki / f"{cert}.key")]
    return [tool, "-h", "localhost", "-p", str(port), *tls, *args]


def test_mosquitto_clients_with_cafile_and_client_certificate(pki, tmp_path):
    b = Broker(pki, tmp_path, ["--mqtt-use-identity-as-username"])
    try:
        topic = unique("mosq")
        sub_id = unique("mosq-sub")
        sub = subprocess.Popen(
            mosquitto("mosquitto_sub", pki, b.ports["mqtts"], "-i", sub_id, "-q", "1", "-t",
                      topic + "/#", "-C", "2", "-v", "-W", "15"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        c = b.wait_connection(lambda c: c["client_id"] == sub_id)
        assert (c["user"], c["ssl"]) == (DEVICE, True), c
        # With a client certificate, and with --cafile only (user and password instead).
        subprocess.run(mosquitto("mosquitto_pub", pki, b.ports["mqtts"], "-q", "1", "-t",
                                 topic + "/cert", "-m", "with certificate"),
                       check=True, timeout=15)
        subprocess.run(mosquitto("mosquitto_pub", pki, b.ports["mqtts"], "-q", "1", "-t",
                                 topic + "/cafile", "-m", "cafile only", "-u", "guest", "-P",
                                 "guest", cert=None),
                       check=True, timeout=15)
        out, err = sub.communicate(timeout=20)
        assert sub.returncode == 0, err
        assert out.splitlines() == [f"{topic}/cert with certificate",
                                    f"{topic}/cafile cafile only"], out
        # Another CA's certificate: mosquitto_pub fails, the broker logs why.
        bad = subprocess.run(mosquitto("mosquitto_pub", pki, b.ports["mqtts"], "-t", topic,
                                       "-m", "x", cert="rogue"),
                             capture_output=True, text=True, timeout=15)
        assert bad.returncode != 0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(
                "TLS handshake failed" in line for line in b.logs):
            time.sleep(0.05)
        assert any("TLS handshake failed" in line for line in b.logs), "".join(b.logs)
    finally:
        b.stop()


def test_perftest_over_tls(pki, broker):
    """RabbitMQ PerfTest (the Java client) over TLS to the AMQPS port, verifying the server
    against the test CA through the JVM's trust store, with scripts/perftest.sh's checks
    (every message confirmed and received, no error or warning). PerfTest's `amqps://`
    scheme would trust any certificate (and warn); `--use-default-ssl-context` makes it use
    the JVM's TLS context instead, on the port that speaks only TLS."""
    assert shutil.which("keytool") and shutil.which("java"), "Java 17 is needed"
    store = pki / "ca.p12"
    if not store.exists():
        subprocess.run(["keytool", "-importcert", "-noprompt", "-alias", "warren-test-ca",
                        "-file", str(pki / "ca.pem"), "-keystore", str(store), "-storetype",
                        "PKCS12", "-storepass", "changeit"], check=True, capture_output=True)
    env = {**os.environ,
           "PERFTEST_JAVA_OPTS": f"-Djavax.net.ssl.trustStore={store} "
                                 "-Djavax.net.ssl.trustStorePassword=changeit "
                                 "-Djavax.net.ssl.trustStoreType=PKCS12",
           "PERFTEST_ARGS": "--use-default-ssl-context"}
    out = subprocess.run([str(ROOT / "scripts" / "perftest.sh"),
                          f"amqp://guest:guest@localhost:{broker.ports['amqps']}", "5000"],
                         env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "receiving rate avg" in out.stdout
    c = [line for line in broker.logs if "accepted AMQP connection" in line]
    assert len(c) >= 2, "".join(broker.logs)
