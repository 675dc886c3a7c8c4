"""The engine's and a worker's ends of a tier's worker channel (``ipc/channels.py``), over real
sockets in this process: hellos, tasks and results each way, a task larger than the kernel takes
at once (queued, then sent as the worker reads), a result of many megabytes (a scan listing), a
worker that goes away, and a connection that names a live worker."""

import os
import threading

import pytest

from kvoffload.ipc.channels import LOADS, STORES, TierChannels, WorkerChannels

PATIENCE_S = 120.0


class Ends:
    """The engine's end (``chans``, refusals in ``refused``) and the workers made on it; all
    closed when the test ends."""

    def __init__(self) -> None:
        self.refused: list[str] = []
        self.chans = TierChannels("test", self.refused.append)
        self.workers: list[WorkerChannels] = []

    def worker(self, kind: str, identity: bytes, hello: bytes = b"") -> WorkerChannels:
        w = WorkerChannels(self.chans.endpoints[kind], identity)
        self.workers.append(w)
        w.say_hello(hello)
        return w

    def until(self, done, what: str):
        """Pump the engine's end (10 ms at a time) until ``done()`` is truthy; its value."""
        for _ in range(int(PATIENCE_S * 100)):
            got = done()
            if got:
                return got
            self.chans.wait_results(0.01)
        raise AssertionError(f"{what} never happened")

    def hellos(self, kind: str) -> list[tuple[bytes, bytes]]:
        return self.until(lambda: self.chans.recv_hellos(kind), f"a hello on {kind}")

    def results(self, n: int) -> list[bytes]:
        got: list[bytes] = []

        def enough():
            got.extend(self.chans.recv_results())
            return len(got) >= n

        self.until(enough, f"{n} result(s)")
        return got


@pytest.fixture
def ends():
    e = Ends()
    yield e
    for w in e.workers:
        w.close()
    e.chans.close()


def test_tasks_and_results_go_each_to_its_own_worker(ends):
    chans = ends.chans
    a = ends.worker(LOADS, b"l0", b"hello-a")
    b = ends.worker(STORES, b"s0", b"hello-b")
    assert ends.hellos(LOADS) == [(b"l0", b"hello-a")]
    assert ends.hellos(STORES) == [(b"s0", b"hello-b")]
    assert not chans.send_task(LOADS, b"s0", b"x")  # s0 is a writer: not on the loads socket
    assert chans.send_task(LOADS, b"l0", b"task-1")
    assert chans.send_task(STORES, b"s0", b"task-2")
    assert a.next_task(PATIENCE_S) == b"task-1"
    assert b.next_task(PATIENCE_S) == b"task-2"
    assert a.try_task() is None and b.try_task() is None
    a.send_result(b"result-1")
    b.send_result(b"result-2")
    assert sorted(ends.results(2)) == [b"result-1", b"result-2"]
    assert ends.refused == []


def test_a_task_larger_than_the_kernel_takes_is_queued_and_a_huge_result_arrives_whole(ends):
    chans = ends.chans
    w = ends.worker(STORES, b"s0")
    ends.hellos(STORES)
    big = os.urandom(8 << 20)  # far past a Unix socket's buffer: sent in parts as it is read
    assert chans.send_task(STORES, b"s0", big)
    assert chans.send_task(STORES, b"s0", b"after")  # queued behind it, in order
    got: list[bytes] = []

    def worker():
        while len(got) < 2:
            t = w.next_task(0.05)
            if t is not None:
                got.append(t)
        w.send_result(big[::-1] * 2)  # 16 MiB: a scan's listing of a large tier

    t = threading.Thread(target=worker)
    t.start()
    results = ends.results(1)  # pumping also sends what waited for the worker
    t.join(PATIENCE_S)
    assert got == [big, b"after"]
    assert results == [big[::-1] * 2]


def test_a_worker_gone_is_not_sent_to_and_a_second_connection_naming_a_live_worker_is_refused(
    ends,
):
    chans = ends.chans
    w = ends.worker(LOADS, b"l0")
    ends.worker(LOADS, b"l0")  # its twin
    assert ends.hellos(LOADS) == [(b"l0", b"")]
    ends.until(lambda: ends.refused, "the twin refused")
    assert ends.refused == ["duplicate"]
    assert len(chans.sockets()) == 3  # the two listening sockets and the first connection
    w.close()
    ends.until(lambda: len(chans.sockets()) == 2, "the end of the worker's stream seen")
    assert not chans.send_task(LOADS, b"l0", b"task")


def test_a_worker_whose_engine_is_gone_waits_quietly_and_drops_its_results(ends):
    w = ends.worker(LOADS, b"l0")
    ends.hellos(LOADS)
    ends.chans.close()
    assert w.next_task(0.01) is None  # reads the end of the stream
    assert w.engine_gone
    assert w.wait(0.05) == {}  # no busy loop on a closed stream
    w.send_result(b"late")  # dropped, no error
