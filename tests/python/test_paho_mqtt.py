"""paho-mqtt 2.x (MQTT 3.1.1 and 5) against a running `warren serve`.

Broker address from WARREN_MQTT (host:port), default 127.0.0.1:1883.
"""
import os
import queue
import uuid

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
import pytest

HOST, PORT = os.environ.get("WARREN_MQTT", "127.0.0.1:1883").rsplit(":", 1)
WAIT = 5


def unique(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


class Client:
    """A paho client with its network loop in a thread; messages and acks land in queues."""

    def __init__(self, protocol, client_id=None, clean=True):
        self.messages = queue.Queue()
        self.subacks = queue.Queue()
        self.connacks = queue.Queue()
        self.c = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2,
            client_id=client_id or unique("paho"),
            protocol=protocol,
            **({} if protocol == mqtt.MQTTv5 else {"clean_session": clean}),
        )
        self.c.on_message = lambda c, u, m: self.messages.put(m)
        self.c.on_subscribe = lambda c, u, mid, codes, props: self.subacks.put(codes)
        self.c.on_connect = lambda c, u, flags, rc, props: self.connacks.put((flags, rc, props))
        self.c.connect(HOST, int(PORT), keepalive=30)
        self.c.loop_start()
        flags, rc, props = self.connacks.get(timeout=WAIT)
        assert not rc.is_failure, rc
        self.props = props

    def subscribe(self, topic, qos):
        self.c.subscribe(topic, qos)
        return self.subacks.get(timeout=WAIT)

    def next(self):
        return self.messages.get(timeout=WAIT)

    def close(self):
        self.c.disconnect()
        self.c.loop_stop()


@pytest.fixture(params=[mqtt.MQTTv311, mqtt.MQTTv5], ids=["v3.1.1", "v5"])
def protocol(request):
    return request.param


def test_publish_subscribe_qos_0_1_2(protocol):
    topic = unique("paho") + "/t"
    sub = Client(protocol)
    codes = sub.subscribe(topic.rsplit("/", 1)[0] + "/+", 2)
    assert [c.value for c in codes] == [2]
    pub = Client(protocol)
    for qos in (0, 1, 2):
        pub.c.publish(topic, f"m{qos}", qos=qos).wait_for_publish(WAIT)
        m = sub.next()
        assert (m.topic, m.payload, m.qos) == (topic, f"m{qos}".encode(), qos)
    sub.close()
    pub.close()


def test_retained_message_to_wildcard_subscriber(protocol):
    base = unique("retained")
    pub = Client(protocol)
    pub.c.publish(f"{base}/a", "kept", qos=1, retain=True).wait_for_publish(WAIT)
    sub = Client(protocol)
    sub.subscribe(f"{base}/#", 1)
    m = sub.next()
    assert (m.topic, m.payload, m.retain) == (f"{base}/a", b"kept", True)
    pub.c.publish(f"{base}/a", b"", qos=1, retain=True).wait_for_publish(WAIT)
    sub.close()
    pub.close()


def test_v5_user_properties_and_connack_limits():
    sub = Client(mqtt.MQTTv5)
    assert sub.props.ReceiveMaximum == 1024
    assert sub.props.TopicAliasMaximum == 64
    topic = unique("props") + "/x"
    sub.subscribe(topic, 1)
    pub = Client(mqtt.MQTTv5)
    props = Properties(PacketTypes.PUBLISH)
    props.UserProperty = [("k", "v")]
    props.ContentType = "text/plain"
    pub.c.publish(topic, "hi", qos=1, properties=props).wait_for_publish(WAIT)
    m = sub.next()
    assert m.payload == b"hi"
    assert m.properties.UserProperty == [("k", "v")]
    assert m.properties.ContentType == "text/plain"
    sub.close()
    pub.close()


def test_persistent_session_v311():
    cid = unique("persist")
    topic = unique("offline") + "/x"
    c = Client(mqtt.MQTTv311, client_id=cid, clean=False)
    c.subscribe(topic, 1)
    c.close()
    pub = Client(mqtt.MQTTv311)
    pub.c.publish(topic, "while away", qos=1).wait_for_publish(WAIT)
    c = Client(mqtt.MQTTv311, client_id=cid, clean=False)
    assert c.next().payload == b"while away"
    c.close()
    pub.close()
