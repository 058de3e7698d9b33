#!/usr/bin/env python3
"""One-to-one MQTT 3.1.1 message rate with raw sockets (no client library in the way): one
subscriber, one publisher pipelining N messages of SIZE bytes at QoS 0 or 1 (the publisher
counts PUBACKs, the subscriber acks every QoS 1 delivery). Prints msgs/s received.

    bench/mqtt-rate.py PORT QOS [N] [SIZE]
"""
import asyncio
import sys
import time


def pkt(kind, body):
    n = len(body)
    rl = bytearray()
    while True:
        b = n % 128
        n //= 128
        rl.append(b | (0x80 if n else 0))
        if not n:
            break
    return bytes([kind]) + bytes(rl) + body


def connect(cid):
    c = cid.encode()
    return pkt(0x10, b"\x00\x04MQTT\x04\x02\x00\x3c" + len(c).to_bytes(2, "big") + c)


async def read_packet(r):
    h = (await r.readexactly(1))[0]
    mult, n = 1, 0
    while True:
        b = (await r.readexactly(1))[0]
        n += (b & 0x7F) * mult
        mult *= 128
        if not b & 0x80:
            break
    return h, await r.readexactly(n)


async def main(port, qos, n, size):
    topic = b"bench/rate"
    sr, sw = await asyncio.open_connection("127.0.0.1", port)
    sw.write(connect("rate-sub") + pkt(0x82, b"\x00\x01" + len(topic).to_bytes(2, "big") + topic + bytes([qos])))
    await read_packet(sr)
    await read_packet(sr)
    pr, pw = await asyncio.open_connection("127.0.0.1", port)
    pw.write(connect("rate-pub"))
    await read_packet(pr)
    payload = b"x" * size
    acked = [0]
    progress = asyncio.Event()
    window = 1000  # QoS 1 messages in flight, under the broker's Receive Maximum

    async def publish():
        for i in range(n):
            while qos and i - acked[0] >= window:
                await pw.drain()
                progress.clear()
                await progress.wait()
            if qos == 0:
                pw.write(pkt(0x30, len(topic).to_bytes(2, "big") + topic + payload))
            else:
                pid = i % 65535 + 1
                pw.write(pkt(0x32, len(topic).to_bytes(2, "big") + topic + pid.to_bytes(2, "big") + payload))
            if i % 256 == 0:
                await pw.drain()
        await pw.drain()

    async def pubacks():
        if qos:
            for _ in range(n):
                await read_packet(pr)
                acked[0] += 1
                progress.set()

    async def receive():
        for _ in range(n):
            h, body = await read_packet(sr)
            if h & 0x06:
                tl = int.from_bytes(body[:2], "big")
                sw.write(pkt(0x40, body[2 + tl:4 + tl]))
        await sw.drain()

    start = time.perf_counter()
    await asyncio.gather(publish(), pubacks(), receive())
    took = time.perf_counter() - start
    print(f"QoS {qos}, {n} x {size} B one-to-one: {n / took:,.0f} msg/s")


if __name__ == "__main__":
    a = sys.argv
    asyncio.run(main(int(a[1]), int(a[2]), int(a[3]) if len(a) > 3 else 100000, int(a[4]) if len(a) > 4 else 16))
