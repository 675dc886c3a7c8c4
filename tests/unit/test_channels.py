"""The worker channels' framing (``ipc/channels.py``): frames cut from a stream however it arrives,
and a length no frame of ours has refused before anything is buffered for it."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.ipc.channels import MAX_FRAME_BYTES, FrameError, _Frames, frame


@given(
    bodies=st.lists(st.binary(max_size=300), max_size=20),
    cuts=st.lists(st.integers(min_value=0, max_value=7000), max_size=30),
)
def test_frames_come_out_whole_and_in_order_however_the_stream_is_cut(bodies, cuts):
    stream = b"".join(frame(b) for b in bodies)
    points = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    frames = _Frames()
    out: list[bytes] = []
    for a, b in zip(points, points[1:]):
        out += frames.feed(stream[a:b])
    assert out == bodies
    assert not frames.buf


def test_a_length_past_the_bound_is_refused_before_its_body_arrives():
    frames = _Frames()
    with pytest.raises(FrameError, match=f"{MAX_FRAME_BYTES + 1} bytes"):
        frames.feed((MAX_FRAME_BYTES + 1).to_bytes(4, "little"))


def test_an_empty_frame_is_a_frame():
    assert _Frames().feed(frame(b"") + frame(b"x")) == [b"", b"x"]
