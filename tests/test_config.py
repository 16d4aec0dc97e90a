"""Config loading (pure): YAML typing, layering node < profile < CLI, line numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from hydra_supervisor.config.config import load_node, load_profile
from hydra_supervisor.config.profile import Mode, PeerLoss
from hydra_supervisor.config.yamlsrc import load_text
from hydra_supervisor.errors import ConfigError


def test_yaml11_on_off_stay_strings_true_false_are_bools():
    src = load_text("a: on\nb: off\nc: yes\nd: true\ne: 'on'\nf: False\n", "x.yaml")
    assert src.data == {"a": "on", "b": "off", "c": "yes", "d": True, "e": "on", "f": False}
    assert src.where(("c",)) == "x.yaml:3"


def test_layering_node_defaults_then_profile_then_cli(tmp_path: Path):
    node_file = tmp_path / "node.yaml"
    node_file.write_text("defaults:\n  server_args: {flash-attn: on, ctx-size: 1024}\n"
                         "  on_peer_loss: fail\n  restart: {max_failures: 9}\n")
    prof = tmp_path / "p.yaml"
    prof.write_text("model: m.gguf\nmode: combine\nserver_args: {ctx-size: 2048}\n"
                    "restart: {backoff_max: 7}\n")
    p = load_profile(prof, load_node(node_file), {"port": 9999})
    assert p.server_args == {"flash-attn": "on", "ctx-size": 2048}
    assert p.on_peer_loss is PeerLoss.FAIL and p.mode is Mode.COMBINE and p.port == 9999
    assert (p.restart.max_failures, p.restart.backoff_max) == (9, 7)
    assert p.name == "p"


def test_node_device_errors_name_line(tmp_path: Path):
    node_file = tmp_path / "node.yaml"
    node_file.write_text("devices:\n  rtx: {cuda: 0}\n  bad: {cuda: 1, cpu: true}\n"
                         "  far: {endpoint: nohostport}\n")
    with pytest.raises(ConfigError) as exc:
        load_node(node_file)
    msg = str(exc.value)
    assert f"{node_file}:3: devices.bad: give exactly one of cuda, cpu, endpoint" in msg
    assert "devices.far.endpoint: expected host:port" in msg


def test_missing_model_key(tmp_path: Path):
    prof = tmp_path / "p.yaml"
    prof.write_text("mode: solo\n")
    with pytest.raises(ConfigError, match="missing required key 'model'"):
        load_profile(prof, load_node(None))


def test_health_section_is_validated(tmp_path: Path):
    prof = tmp_path / "p.yaml"
    prof.write_text("model: m\nhealth:\n  hang_timout: 5\n")
    with pytest.raises(ConfigError, match=r"p.yaml:3: health.hang_timout: unknown key .*"
                                          r"did you mean .hang_timeout."):
        load_profile(prof, load_node(None))


def test_install_progress_reports_ninja_steps(tmp_path: Path):
    from hydra_supervisor.tools.install import _run_with_progress

    log = tmp_path / "build.log"
    seen: list[str] = []
    script = 'for i in 1 2 3; do echo "[$i/3] Building CXX object src/f$i.cpp.o"; sleep 0.3; done'
    with log.open("w") as out:
        rc = _run_with_progress(["bash", "-c", script], out, log, seen.append, every=0.1)
    assert rc == 0
    assert seen and seen[0].strip().startswith("[1/3]") and "f1.cpp.o" in seen[0]
    assert len(seen) == len(set(seen))  # each step said once


def test_install_options_key_the_cache():
    from hydra_supervisor.tools.install import BuildOptions, build_dir

    cpu, cuda = BuildOptions(), BuildOptions(cuda=True, cuda_archs="86;120")
    assert build_dir(cpu).name == "11434.0.0-r3-cpu"
    assert build_dir(cuda).name == "11434.0.0-r3-cuda-86_120"
    assert "-DGGML_RPC=ON" in cpu.cmake_args() and "-DGGML_CUDA=ON" in cuda.cmake_args()
    assert "-DCMAKE_CUDA_ARCHITECTURES=86;120" in cuda.cmake_args()


def test_self_connect_is_detected():
    """TCP simultaneous open: a socket bound to port P that connects to P is connected to
    itself -- what a retried connect to a down local port can stumble into."""
    import socket

    from hydra_supervisor.plan.ports import self_connected
    from hydra_supervisor.testing.harness import free_port

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.connect(("127.0.0.1", port))
        assert self_connected(s)
    with socket.socket() as srv, socket.socket() as c:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        c.connect(srv.getsockname())
        assert not self_connected(c)


def test_routing_keys_layer_and_validate(tmp_path: Path):
    node_file = tmp_path / "node.yaml"
    node_file.write_text("profiles: [a, b]\ndefault_profile: b\n"
                         "defaults:\n  min_resident: 5\n  ttl: 600\n")
    node = load_node(node_file)
    assert node.profiles == ("a", "b") and node.default_profile == "b"
    prof = tmp_path / "a.yaml"
    prof.write_text("model: m.gguf\naliases: [alpha, first]\nttl: 0\nconcurrency: 2\n"
                    "queue: 0\non_demand: false\n")
    p = load_profile(prof, node)
    assert p.aliases == ("alpha", "first") and p.ttl == 0.0 and p.min_resident == 5.0
    assert (p.concurrency, p.queue, p.on_demand) == (2, 0, False)
    prof.write_text("model: m.gguf\nttl: -1\nconcurrency: 0\nqueue: lots\nmin_resdent: 3\n")
    with pytest.raises(ConfigError) as exc:
        load_profile(prof, node)
    msg = str(exc.value)
    assert "a.yaml:2: ttl: expected a number of seconds (0 or more), got -1" in msg
    assert "a.yaml:3: concurrency: expected a whole number of at least 1, got 0" in msg
    assert "a.yaml:4: queue: expected a whole number (0 or more)" in msg
    assert "did you mean 'min_resident'?" in msg
    node_file.write_text("profiles: a\ndefault_profle: a\n")
    with pytest.raises(ConfigError, match="did you mean 'default_profile'"):
        load_node(node_file)
