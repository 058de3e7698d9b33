#!/usr/bin/env python3
"""SUBACK latency (MQTT 3.1.1 over raw loopback sockets, no client library in the way): N
SUBSCRIBEs of fresh topics one after another on one connection (clean session, or a
persistent one with clean=0), each timed from send to SUBACK, reported as p50/p90/p99/max;
then the window: a publisher on another connection publishes to the topic right after the
SUBSCRIBE is sent (before the SUBACK is read), and the rounds whose publish never arrives
are counted. Run it against Warren and Mosquitto in the same session (docs/mqtt.md).
Logs in as guest/guest. usage: mqtt-suback-latency.py PORT N [clean: 1 (default) or 0]"""
import socket,struct,sys,time
port=int(sys.argv[1]); n=int(sys.argv[2]); clean=int(sys.argv[3]) if len(sys.argv)>3 else 1
def pkt(t,body):
    l=len(body); rl=b''
    while True:
        d=l%128; l//=128
        rl+=bytes([d|(0x80 if l else 0)])
        if not l: break
    return bytes([t])+rl+body
def s(x): return struct.pack('>H',len(x))+x
def readpkt(c):
    h=c.recv(1)
    if not h: raise EOFError
    mult=1; l=0
    while True:
        b=c.recv(1)[0]; l+=(b&127)*mult; mult*=128
        if not b&128: break
    body=b''
    while len(body)<l: body+=c.recv(l-len(body))
    return h[0],body
def connect(cid, clean=1):
    c=socket.create_connection(('127.0.0.1',port)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY,1); c.settimeout(5)
    flags=0xC0|(2 if clean else 0)
    c.sendall(pkt(0x10, s(b'MQTT')+bytes([4,flags])+struct.pack('>H',60)+s(cid)+s(b'guest')+s(b'guest')))
    t,b=readpkt(c); assert t==0x20 and b[1]==0, (t,b)
    return c
tag=str(int(time.time()*1000)%100000).encode()
sub=connect(b'lat-sub-'+tag, clean)
lat=[]
for i in range(1,n+1):
    t0=time.perf_counter()
    sub.sendall(pkt(0x82, struct.pack('>H',i)+s(b'lat/'+tag+b'/%d'%i)+b'\x00'))
    while True:
        t,b=readpkt(sub)
        if t==0x90: break
    lat.append((time.perf_counter()-t0)*1e3)
lat.sort()
pct=lambda p: lat[min(len(lat)-1,int(len(lat)*p))]
print(f"port {port} clean={clean} SUBACK ms over {n}: p50 {pct(0.5):.3f} p90 {pct(0.9):.3f} p99 {pct(0.99):.3f} max {lat[-1]:.3f}")
# The window: publish from another connection as soon as the SUBSCRIBE is sent.
pub=connect(b'lat-pub-'+tag)
missed=0; rounds=min(n,200)
for i in range(rounds):
    topic=b'win/'+tag+b'/%d'%i
    sub.sendall(pkt(0x82, struct.pack('>H',(i%60000)+1)+s(topic)+b'\x00'))
    pub.sendall(pkt(0x30, s(topic)+b'x'))
    got=False
    sub.settimeout(0.3)
    try:
        while True:
            t,b=readpkt(sub)
            if t&0xF0==0x30: got=True; break
    except socket.timeout: pass
    sub.settimeout(5)
    missed+= not got
print(f"port {port} clean={clean} publish right after SUBSCRIBE missed: {missed} of {rounds}")
