"""The wire codec on hand-built byte strings from docs/protocol.md (no sockets)."""

from __future__ import annotations

import json
import random

import pytest

from hydra_supervisor.wire.codec import (
    FrameEnd,
    FrameError,
    Limits,
    Op,
    PayloadChunk,
    RequestHead,
    RequestParser,
    ResponseHead,
    ResponseParser,
    Status,
    encode_request,
    encode_response,
    request_header,
    response_header,
)

# INFO, key "", trace "t1", no payload — written out byte by byte from the spec:
# u16 magic 0x4859 LE = 59 48, op 41, flags 00, key_len 0000, payload_len 0 (8 bytes), trace_len 2
INFO_T1 = bytes.fromhex("5948" "41" "00" "0000" "0000000000000000" "0200") + b"t1"
# CONFIGURE, key "0", payload {"top_k":5}
CFG_PAYLOAD = b'{"top_k":5}'
CONFIGURE_0 = (bytes.fromhex("5948" "40" "00" "0100") + (11).to_bytes(8, "little")
               + bytes.fromhex("0000") + b"0" + CFG_PAYLOAD)
# response: status OK, meta {"a":1} (7 bytes), payload b"xyz"
RESP_OK = bytes.fromhex("00" "070000" "0300000000000000") + b'{"a":1}' + b"xyz"


def collect(parser: RequestParser | ResponseParser, data: bytes, step: int | None = None) -> list:
    out = []
    if step is None:
        out += parser.feed(data)
    else:
        for i in range(0, len(data), step):
            out += parser.feed(data[i:i + step])
    return out


def merge(events: list) -> list:
    """Coalesce consecutive PayloadChunks, so split feeds compare equal to a whole feed."""
    out: list = []
    for e in events:
        if isinstance(e, PayloadChunk) and out and isinstance(out[-1], PayloadChunk):
            out[-1] = PayloadChunk(out[-1].data + e.data)
        else:
            out.append(e)
    return out


def test_encoders_match_the_hand_built_bytes() -> None:
    assert encode_request(Op.INFO, trace="t1") == INFO_T1
    assert encode_request(Op.CONFIGURE, "0", CFG_PAYLOAD) == CONFIGURE_0
    assert encode_response(Status.OK, {"a": 1}, b"xyz") == RESP_OK
    assert request_header(Op.STATE_PUT, "3", 1 << 40)[6:14] == (1 << 40).to_bytes(8, "little")
    assert response_header(Status.BUSY, None) == bytes([4]) + bytes(11)


def test_request_parser_golden_whole_and_byte_by_byte() -> None:
    data = INFO_T1 + CONFIGURE_0
    want = [RequestHead(0x41, 0, "", "t1", 0), FrameEnd(),
            RequestHead(0x40, 0, "0", "", 11), PayloadChunk(CFG_PAYLOAD), FrameEnd()]
    assert merge(collect(RequestParser(Limits()), data)) == want
    for step in (1, 2, 3, 7, 16, 17):
        assert merge(collect(RequestParser(Limits()), data, step)) == want


def test_payload_is_streamed_not_buffered() -> None:
    p = RequestParser(Limits(op_payload={Op.STATE_PUT: 1 << 30}))
    events = p.feed(request_header(Op.STATE_PUT, "0", 3000))
    assert events == [RequestHead(0x31, 0, "0", "", 3000)]
    got = 0
    for _ in range(3):
        ev = p.feed(b"x" * 1000)
        assert isinstance(ev[0], PayloadChunk) and len(ev[0].data) == 1000
        got += 1000
    assert ev[-1] == FrameEnd() and p.idle
    assert len(p._buf) == 0  # nothing of the payload was kept


@pytest.mark.parametrize(
    "frame, words",
    [
        (b"GE" + bytes(14), "bad magic"),
        (bytes.fromhex("5948" "41" "00" "2c01") + bytes(10), "key_len 300"),
        (encode_request(Op.INFO)[:14] + (5000).to_bytes(2, "little"), "trace_len 5000"),
        (request_header(Op.CONFIGURE, "", (1 << 64) - 1), "payload_len 18446744073709551615"),
        (request_header(Op.STATE_PUT, "0", (4 << 30) + 1), "for STATE_PUT"),
        (bytes.fromhex("5948" "41" "00" "0200") + bytes(10) + b"\xff\xfe", "not UTF-8"),
    ],
)
def test_bad_headers_fail_at_the_header(frame: bytes, words: str) -> None:
    limits = Limits(op_payload={Op.STATE_PUT: 4 << 30})
    p = RequestParser(limits)
    events = p.feed(frame + b"more bytes that must be ignored")
    assert len(events) == 1 and isinstance(events[0], FrameError), events
    assert events[0].status == Status.BAD_REQUEST and words in events[0].message
    assert p.failed and p.feed(INFO_T1) == []  # stops for good


def test_eof_mid_frame_is_an_error_between_frames_is_not() -> None:
    for cut in range(1, len(CONFIGURE_0)):
        p = RequestParser(Limits())
        p.feed(CONFIGURE_0[:cut])
        ev = p.eof()
        assert len(ev) == 1 and isinstance(ev[0], FrameError), cut
    p = RequestParser(Limits())
    p.feed(CONFIGURE_0)
    assert p.eof() == []


def test_random_bytes_never_raise() -> None:
    rng = random.Random(1234)
    for _ in range(2000):
        blob = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
        if rng.random() < 0.5:
            blob = b"YH" + blob
        p = RequestParser(Limits())
        events = collect(p, blob, rng.randint(1, 9)) + p.eof()
        for e in events:
            assert isinstance(e, RequestHead | PayloadChunk | FrameEnd | FrameError)
        q = ResponseParser(Limits())
        collect(q, blob, rng.randint(1, 9))
        q.eof()


def test_response_parser_golden_and_caps() -> None:
    for step in (None, 1, 5):
        ev = merge(collect(ResponseParser(Limits()), RESP_OK, step))
        assert ev == [ResponseHead(0, {"a": 1}, 3), PayloadChunk(b"xyz"), FrameEnd()]
    big_meta = bytes([0]) + (0xFFFFFF).to_bytes(3, "little") + bytes(8)
    ev = ResponseParser(Limits(meta=1 << 20)).feed(big_meta)
    assert isinstance(ev[0], FrameError) and "meta_len" in ev[0].message
    huge = bytes([0, 0, 0, 0]) + (1 << 63).to_bytes(8, "little")
    ev = ResponseParser(Limits(payload=1 << 30)).feed(huge)
    assert isinstance(ev[0], FrameError) and "payload_len" in ev[0].message
    bad_json = bytes([2]) + (3).to_bytes(3, "little") + bytes(8) + b"{x}"
    ev = ResponseParser(Limits()).feed(bad_json)
    assert isinstance(ev[0], FrameError) and "not JSON" in ev[0].message


def test_meta_too_big_for_u24_is_refused_by_the_encoder() -> None:
    with pytest.raises(ValueError, match="u24"):
        response_header(0, {"x": "a" * (1 << 24)})
    meta = json.loads(RESP_OK[12:19])
    assert meta == {"a": 1}
