"""The classifier on byte literals: every first byte, every method prefix, garbage, stability."""

from __future__ import annotations

import random
import struct

import pytest

from hydra_supervisor.router.classify import HTTP_METHODS, MAX_PREFIX, Kind, classify

TCHAR = set(b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def hydra_header(op: int, key: bytes = b"", payload_len: int = 0, trace: bytes = b"") -> bytes:
    # u16 magic, u8 op, u8 flags, u16 key_len, u64 payload_len, u16 trace_len (little-endian)
    return struct.pack("<HBBHQH", 0x4859, op, 0, len(key), payload_len, len(trace)) + key + trace


RPC_HELLO = bytes([0x0E]) + (0).to_bytes(8, "little")


def test_empty_needs_more() -> None:
    assert classify(b"") is Kind.NEED_MORE


@pytest.mark.parametrize("byte", range(256))
def test_every_first_byte(byte: int) -> None:
    got = classify(bytes([byte]))
    if byte == 0x0E:
        assert got is Kind.RPC
    elif byte == 0x59 or byte in TCHAR or byte == 0x0D:  # "Y" of "YH", a token, an empty line
        assert got is Kind.NEED_MORE
    else:
        assert got is Kind.REJECT


def test_real_rpc_hello() -> None:
    assert classify(RPC_HELLO) is Kind.RPC
    assert classify(RPC_HELLO[:1]) is Kind.RPC


@pytest.mark.parametrize("op", [0x30, 0x31, 0x32, 0x40, 0x41, 0x42, 0x43, 0x44, 0x45, 0x46])
def test_real_hydra_headers(op: int) -> None:
    header = hydra_header(op, key=b"3", payload_len=17, trace=b"trace-1")
    assert header[:2] == b"YH"
    for n in range(2, len(header) + 1):
        assert classify(header[:n]) is Kind.HYDRA
    assert classify(header[:1]) is Kind.NEED_MORE


@pytest.mark.parametrize("op", range(0x30, 0x47))
def test_bare_hydra_opcode_is_not_hydra(op: int) -> None:
    # The fork's design doc claimed one-byte dispatch on 0x30–0x46; every real client sends the
    # magic first. 0x43 'C' and 0x44 'D' start CONNECT/DELETE, so they must stay HTTP candidates.
    got = classify(bytes([op, 0, 0, 0, 0, 0, 0, 0]))
    assert got is not Kind.HYDRA
    if bytes([op]) in (b"C", b"D"):
        assert classify(bytes([op])) is Kind.NEED_MORE
    assert got is Kind.REJECT


@pytest.mark.parametrize("line", [b"get / HTTP/1.1", b"FOO / HTTP/1.1", b"\r\nGET / HTTP/1.1",
                                  b"\r\n\r\nGET / HTTP/1.1", b"GE T /"])
def test_http_like_lines_go_to_http(line: bytes) -> None:
    # llama-server answers these with 400 (or serves them): so does the port, not a close.
    assert classify(line) is Kind.HTTP


def test_y_then_wrong_second_byte() -> None:
    assert classify(b"YX") is Kind.REJECT
    assert classify(b"Y\x00") is Kind.REJECT
    assert classify(b"HY") is Kind.NEED_MORE  # a token so far: "HY / HTTP/1.1" is HTTP (400)


@pytest.mark.parametrize("method", HTTP_METHODS)
def test_http_methods_and_their_prefixes(method: bytes) -> None:
    request = method + b"/v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n"
    for n in range(1, len(method)):
        assert classify(method[:n]) is Kind.NEED_MORE, method[:n]
    for n in range(len(method), len(request) + 1):
        assert classify(request[:n]) is Kind.HTTP, request[:n]


@pytest.mark.parametrize("method", HTTP_METHODS)
def test_method_without_space_or_lowercase_is_rejected(method: bytes) -> None:
    name = method[:-1]
    assert classify(name + b"X") is Kind.NEED_MORE  # still a token: "GETX " is HTTP (400)
    assert classify(name + b"\t") is Kind.REJECT
    assert classify(name + b"/") is Kind.REJECT
    assert classify(method.lower()) is Kind.HTTP


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # TLS ClientHello
        b"SSH-2.0-OpenSSH_9.6\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # h2c prior knowledge: llama-server speaks 1.1 only
        b"\x00\x00\x00\x00",
        b"\xff" * 16,
        b"\r\n\r\n\r\n",
        b" GET / HTTP/1.1",
        b"\nGET / HTTP/1.1",
        b"POS",  # still a prefix: covered below, must not be REJECT
    ],
)
def test_garbage(garbage: bytes) -> None:
    if garbage == b"POS":
        assert classify(garbage) is Kind.NEED_MORE
    else:
        assert classify(garbage) is Kind.REJECT


def test_all_two_byte_prefixes() -> None:
    for a in range(256):
        for b in range(256):
            p = bytes([a, b])
            got = classify(p)
            if a == 0x0E:
                assert got is Kind.RPC
            elif p == b"YH":
                assert got is Kind.HYDRA
            elif a == 0x59:
                assert got is Kind.REJECT, p
            elif p == b"\r\n" or (a in TCHAR and b in TCHAR):
                assert got is Kind.NEED_MORE, p
            elif a in TCHAR and b == 0x20:
                assert got is Kind.HTTP, p
            else:
                assert got is Kind.REJECT, p


def test_need_more_only_on_strict_prefixes() -> None:
    # A caller that buffers MAX_PREFIX bytes always gets a final decision.
    assert MAX_PREFIX == 21
    rng = random.Random(1234)
    alphabet = b"GETPOSHADLUCNIRYX \x0e\x00"
    for _ in range(20000):
        p = bytes(rng.choice(alphabet) for _ in range(rng.randint(MAX_PREFIX, MAX_PREFIX + 4)))
        assert classify(p) is not Kind.NEED_MORE, p


def test_final_decisions_are_stable_under_more_bytes() -> None:
    rng = random.Random(99)
    seeds = [RPC_HELLO, hydra_header(0x41), b"YX", b"\x16\x03"] + [m for m in HTTP_METHODS]
    seeds += [bytes(rng.randrange(256) for _ in range(rng.randint(1, 10))) for _ in range(2000)]
    for s in seeds:
        for n in range(1, len(s) + 1):
            head = s[:n]
            first = classify(head)
            if first is Kind.NEED_MORE:
                continue
            for _ in range(5):
                tail = bytes(rng.randrange(256) for _ in range(rng.randint(1, 12)))
                assert classify(head + tail) is first, (head, tail)


def test_pure_same_input_same_output() -> None:
    inputs = [b"", b"G", b"GET ", b"\x0e", b"YH", b"\xff"]
    assert [classify(i) for i in inputs] == [classify(i) for i in inputs]


@pytest.mark.parametrize("magic", [0x4858, 0x5948, 0x0000, 0xFFFF])
def test_a_first_frame_with_a_bad_magic_is_no_wire_client(magic: int) -> None:
    """docs/protocol.md: a first frame without the magic never reaches the wire server (the
    router cannot answer in a protocol the client did not speak; it closes without a byte)."""
    frame = struct.pack("<HBBHQH", magic, 0x41, 0, 0, 0, 0)
    assert classify(frame) is Kind.REJECT
