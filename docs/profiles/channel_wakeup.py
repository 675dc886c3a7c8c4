"""What the engine thread pays per task sent to a worker and per result picked up, ZMQ against a
plain Unix stream socket, when the messages come one scheduler step apart (issue 26; section 7 of
docs/profiles/engine.md)::

    python docs/profiles/channel_wakeup.py [--n 300] [--gap-ms 2]

A worker process echoes each task as a 200-byte result. ZMQ: a ROUTER sends (identity + task,
as ``TierChannels`` did), the worker's DEALER receives, its PUSH answers to the engine's PULL,
drained as the tier did (``poll(2)`` on ZMQ_FD, then ``recv`` until ``Again``). Plain: one
``AF_UNIX`` stream both ways (``ipc/channels.py`` now: ``send``, then ``poll`` + ``recv``).
Engine-thread CPU per call (``time.thread_time``), medians of ``--n`` rounds ``--gap-ms`` apart.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import select
import socket
import statistics
import time

import zmq


def _zmq_worker(jobs: str, results: str) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.ROUTING_ID, b"w1")
    s.connect(jobs)
    r = ctx.socket(zmq.PUSH)
    r.connect(results)
    s.send(b"hello")
    while (m := s.recv()) != b"stop":
        r.send(m[:1] * 200)


def _plain_worker(addr: str) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(addr)
    while (m := s.recv(65536)) and m != b"stop":
        s.sendall(m[:1] * 200)


def zmq_costs(n: int, gap_s: float) -> tuple[float, float]:
    ctx = zmq.Context()
    jobs, res = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL)
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    jobs.bind(f"ipc://@chwake-j-{tag}")
    res.bind(f"ipc://@chwake-r-{tag}")
    p = mp.get_context("spawn").Process(
        target=_zmq_worker, args=(f"ipc://@chwake-j-{tag}", f"ipc://@chwake-r-{tag}")
    )
    p.start()
    ident, _ = jobs.recv_multipart()
    fd = select.poll()
    fd.register(res.getsockopt(zmq.FD), select.POLLIN)
    sends, picks = [], []
    for _ in range(n):
        c0 = time.thread_time()
        jobs.send(ident, zmq.SNDMORE | zmq.NOBLOCK)
        jobs.send(b"t" * 100, zmq.NOBLOCK)
        sends.append(time.thread_time() - c0)
        time.sleep(gap_s)
        c0 = time.thread_time()
        fd.poll(0)
        got = 0
        try:
            while True:
                res.recv(zmq.NOBLOCK)
                got += 1
        except zmq.Again:
            pass
        picks.append(time.thread_time() - c0)
        while not got:  # a result later than the gap: not timed
            res.recv()
            got = 1
    jobs.send(ident, zmq.SNDMORE)
    jobs.send(b"stop")
    p.join()
    ctx.destroy(0)
    return statistics.median(sends) * 1e6, statistics.median(picks) * 1e6


def plain_costs(n: int, gap_s: float) -> tuple[float, float]:
    addr = f"\0chwake-{os.getpid()}-{time.monotonic_ns()}"
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(addr)
    lst.listen()
    p = mp.get_context("spawn").Process(target=_plain_worker, args=(addr,))
    p.start()
    c, _ = lst.accept()
    c.setblocking(False)
    pl = select.poll()
    pl.register(c, select.POLLIN)
    buf = bytearray(1 << 18)
    sends, picks = [], []
    for _ in range(n):
        c0 = time.thread_time()
        c.send(b"t" * 100)
        sends.append(time.thread_time() - c0)
        time.sleep(gap_s)
        c0 = time.thread_time()
        got = pl.poll(0) and c.recv_into(buf)
        picks.append(time.thread_time() - c0)
        if not got:
            pl.poll(-1)
            c.recv_into(buf)
    c.setblocking(True)
    c.sendall(b"stop")
    p.join()
    c.close()
    lst.close()
    return statistics.median(sends) * 1e6, statistics.median(picks) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--gap-ms", type=float, default=2.0)
    a = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}; {a.n} rounds, {a.gap_ms} ms apart")
    for name, fn in (("zmq", zmq_costs), ("plain", plain_costs), ("zmq", zmq_costs)):
        s, r = fn(a.n, a.gap_ms / 1e3)
        print(f"{name:6s} send {s:6.1f} us   result pick-up {r:6.1f} us   (engine-thread CPU, median)")


if __name__ == "__main__":
    main()
