"""A program of its own on a p2p TCP data port (``kvoffload.workers.p2p_transport``), speaking the real
wire protocol from a test process: what a peer that holds a session's data token (or none) can do
there, honest or hostile."""

from __future__ import annotations

import contextlib
import os
import socket
import struct

import msgspec
from helpers import patience

from kvoffload.workers import p2p_transport as pt

PATIENCE_S = patience(60.0)  # upper bound for an answer: never a measure of speed


def frame(obj) -> bytes:
    """One frame: a 4-byte little-endian length, then msgpack."""
    body = msgspec.msgpack.encode(obj)
    return struct.pack("<I", len(body)) + body


class DataClient:
    """A program of its own on a TCP data port, speaking the real wire protocol."""

    def __init__(self, desc: pt.TcpDescriptor, source: str = "127.0.0.1"):
        self.sock = socket.socket()
        self.sock.settimeout(PATIENCE_S)
        self.sock.bind((source, 0))
        self.sock.connect((desc.host, desc.port))

    def authenticate(self, token: bytes) -> None:
        """The session's challenge-response (the server proves the token first)."""
        sid, cnonce = pt.session_id(token), os.urandom(32)
        self.sock.sendall(frame(pt.DataHello(sid, cnonce)))
        ch = msgspec.msgpack.decode(self.recv_frame(), type=pt.DataChallenge)
        assert ch.mac == pt.data_mac(token, b"server", sid, cnonce, ch.nonce)
        self.sock.sendall(frame(pt.DataAuth(pt.data_mac(token, b"client", sid, cnonce, ch.nonce))))
        msgspec.msgpack.decode(self.recv_frame(), type=pt.DataReady)  # the proof was taken

    def recv_frame(self) -> bytes:
        head = self.recv_exact(4)
        return self.recv_exact(struct.unpack("<I", head)[0])

    def recv_exact(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            assert chunk, "closed"
            out += chunk
        return out

    def read(self, slots: list[int]) -> pt.TcpReply:
        self.sock.sendall(frame(pt.TcpRequest("read", 1, slots)))
        return msgspec.msgpack.decode(self.recv_frame(), type=pt.TcpReply)

    def closed_after(self, payload: bytes = b"") -> bytes:
        """Send ``payload``; everything the server sends until it closes the connection."""
        with contextlib.suppress(OSError):
            self.sock.sendall(payload)
        data = b""
        with contextlib.suppress(ConnectionResetError):  # closed with our bytes unread
            while chunk := self.sock.recv(65536):
                data += chunk
        self.sock.close()
        return data
