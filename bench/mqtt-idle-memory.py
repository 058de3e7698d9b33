#!/usr/bin/env python3
"""Broker memory per idle MQTT connection: opens N raw MQTT 3.1.1 connections to a running
broker, each with one QoS 1 subscription, and reports the growth of the broker's RSS.

    bench/mqtt-idle-memory.py PID PORT [N] [SUBSCRIPTIONS]

PID is the broker process (its RSS is read from /proc/PID/status), PORT its MQTT port on
127.0.0.1. Needs a file-descriptor limit above N (ulimit -n).
"""
import asyncio
import resource
import sys


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def connect_packet(client_id):
    cid = client_id.encode()
    body = b"\x00\x04MQTT\x04\x02\x00\x00" + len(cid).to_bytes(2, "big") + cid
    return bytes([0x10, len(body)]) + body


def subscribe_packet(topic):
    t = topic.encode()
    body = b"\x00\x01" + len(t).to_bytes(2, "big") + t + b"\x01"
    return bytes([0x82, len(body)]) + body


SUBSCRIBE = True


async def one(port, i, conns):
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(connect_packet(f"idle-{i}") + (subscribe_packet(f"devices/{i}/cmd") if SUBSCRIBE else b""))
    await w.drain()
    ack = await r.readexactly(4)
    assert ack == b"\x20\x02\x00\x00", ack
    if SUBSCRIBE:
        suback = await r.readexactly(5)
        assert suback[0] == 0x90 and suback[4] == 1, suback
    conns.append((r, w))


async def main(pid, port, n):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, n + 100)), hard))
    conns = []
    # Warm up: the first connections pay for one-time allocations (runtime, maps).
    for i in range(100):
        await one(port, i, conns)
    await asyncio.sleep(1)
    before = rss_kib(pid)
    batch = 500
    for start in range(100, n + 100, batch):
        await asyncio.gather(*(one(port, i, conns) for i in range(start, min(start + batch, n + 100))))
    await asyncio.sleep(2)
    after = rss_kib(pid)
    per = (after - before) * 1024 / n
    what = "one subscription each" if SUBSCRIBE else "no subscription"
    print(f"{n} idle connections, {what}: broker RSS {before} KiB -> {after} KiB, "
          f"{per:.0f} bytes per connection")
    for _, w in conns:
        w.close()


if __name__ == "__main__":
    SUBSCRIBE = len(sys.argv) <= 4 or sys.argv[4] != "0"
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 10000))
