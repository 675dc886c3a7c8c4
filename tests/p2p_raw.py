"""Hand-driven control sessions with a serving instance, for the p2p tests: the protocol
(:mod:`kvoffload.ipc.peer_messages`) spoken from a test, with or without the secret's CurveZMQ
keys, so a test can play a peer that follows the protocol, breaks it, or claims another identity.
"""

from __future__ import annotations

import os

import zmq
from helpers import patience

from kvoffload.ipc import peer_messages as pm

PATIENCE_S = patience(120.0)  # upper bound for an answer (seconds): never a measure of speed


class RawClient:
    """A DEALER to ``addr`` speaking the control protocol.

    Args:
        addr: the server's ``host:port``.
        namespace_id: the namespace its Hello names.
        secret: the shared secret (bytes) its CurveZMQ keys and MACs come from; None: a plain
            ZMQ socket (no CurveZMQ), as a client that does not know the secret would use.
        incarnation: its identity (random by default).
        advertise: the address it claims in Hello.
        dialed: the address its Hello says it dialed (``addr`` by default).
    """

    def __init__(
        self,
        addr: str,
        namespace_id: str,
        secret: bytes | None,
        *,
        incarnation: bytes | None = None,
        advertise: str = "127.0.0.1:1",
        dialed: str | None = None,
    ):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if secret is not None:
            public, private = pm.curve_keypair(secret)
            self.sock.curve_serverkey = public
            self.sock.curve_publickey = public
            self.sock.curve_secretkey = private
        self.sock.connect(f"tcp://{addr}")
        self.key = pm.transcript_key(secret or b"")
        self.incarnation = incarnation or os.urandom(pm.INCARNATION_BYTES)
        self.namespace_id = namespace_id
        self.advertise = advertise
        self.dialed = addr if dialed is None else dialed

    def send(self, msg) -> None:
        self.sock.send(msg if isinstance(msg, bytes) else pm.encode(msg))

    def ask(self, msg) -> object:
        self.send(msg)
        return self.recv()

    def recv(self, timeout_s: float = PATIENCE_S) -> object:
        """The next message from the server; a Heartbeat it sends unasked (as it does to learn
        whether a session still lives) is answered, as a live client does, and skipped."""
        while True:
            assert self.sock.poll(int(timeout_s * 1000)), "no answer"
            msg = pm.decode(self.sock.recv())
            if not isinstance(msg, pm.Heartbeat):
                return msg
            self.send(pm.HeartbeatAck(msg.seq, 0))

    def hello(self) -> pm.Hello:
        return pm.Hello(
            pm.PROTOCOL_VERSION,
            self.incarnation,
            self.advertise,
            self.dialed,
            self.namespace_id,
            os.urandom(pm.NONCE_BYTES),
        )

    def handshake(self, descriptor: bytes = b"") -> object:
        """Hello, check the Challenge, Auth: the server's answer to Auth (a Welcome whose MAC was
        checked, or a Refused)."""
        hello = self.hello()
        ch = self.ask(hello)
        if not isinstance(ch, pm.Challenge):
            return ch
        assert pm.mac_ok(pm.handshake_mac(self.key, "server", hello, ch), ch.mac)
        auth = pm.Auth(pm.ZERO_MAC, descriptor)
        auth.mac = pm.handshake_mac(self.key, "client", hello, ch, auth)
        welcome = self.ask(auth)
        if isinstance(welcome, pm.Welcome):
            want = pm.handshake_mac(self.key, "welcome", hello, ch, auth, welcome)
            assert pm.mac_ok(want, welcome.mac)
        return welcome

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
