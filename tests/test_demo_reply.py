"""The first run, as the README tells it: `hydra up --profile demo`, then the README's curl
request, answered within 30 s with text that went through Gemma's chat template; and the
`ready:` lines with `--port 0` and an IPv6 host (the real port, the address in brackets)."""

from __future__ import annotations

import json
import re
import time

import pytest
import requests

from hydra_supervisor.testing.harness import REPO, free_port, status_json

pytestmark = pytest.mark.slow

_CURL = re.compile(r"curl (?P<base>http://\S+?)(?P<path>/v1/chat/completions) "
                   r"-H 'Content-Type: application/json' -d '(?P<body>\{.*\})'")


def _readme_request() -> tuple[str, str, dict[str, object]]:
    """The curl line of the README's demo section: (base URL, path, JSON body)."""
    text = (REPO / "README.md").read_text()
    m = _CURL.search(text)
    assert m, "the README has no demo curl line"
    return m["base"], m["path"], json.loads(m["body"])


def test_readme_request_answers_in_seconds_through_gemma_template(hydra_up):
    base, path, body = _readme_request()
    assert base == "http://127.0.0.1:8080" and "max_tokens" not in body
    port = free_port()
    up = hydra_up("--profile", "demo", "--port", str(port))
    up.wait_ready()
    url = f"http://127.0.0.1:{port}"
    # What hydra prints is what the README shows (but for the port).
    printed = _CURL.search(up.output())
    assert printed and printed["base"] == url and json.loads(printed["body"]) == body

    # The prompt goes through Gemma's template (not ChatML, not a Jinja template "gemma").
    rendered = requests.post(f"{url}/apply-template", json=body, timeout=30).json()["prompt"]
    assert "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n" in rendered
    assert "<|im_start|>" not in rendered

    t0 = time.monotonic()
    reply = requests.post(f"{url}{path}", json=body, timeout=30)
    elapsed = time.monotonic() - t0
    assert reply.status_code == 200, reply.text
    data = reply.json()
    choice = data["choices"][0]
    text = choice["message"]["content"]
    assert elapsed < 30, f"the README's request took {elapsed:.1f}s"
    # Readable text: words, none of the chat-format tokens a wrong template leaks.
    assert re.search(r"[A-Za-z]{2,}", text), text
    for leak in ("<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>"):
        assert leak not in text, text
    assert choice["finish_reason"] in ("stop", "length")
    assert 0 < data["usage"]["completion_tokens"] <= 64  # the demo's n-predict
    assert data["usage"]["prompt_tokens"] >= 8  # the template's turn markers, not just "Hello"


def test_port_zero_and_ipv6_host_show_the_real_bracketed_url(hydra_up, hydra_env):
    up = hydra_up("--profile", "demo", "--host", "::1", "--port", "0")
    up.wait_ready()
    out = up.output()
    m = re.search(r"ready: demo serving \S+ at http://\[::1\]:(\d+)\n", out)
    assert m, out
    port = int(m[1])
    assert port > 0 and ":0/" not in out and "http://::1" not in out
    assert f"curl http://[::1]:{port}/v1/chat/completions" in out
    assert status_json(hydra_env)["status"]["url"] == f"http://[::1]:{port}"
    assert requests.get(f"http://[::1]:{port}/health", timeout=10).status_code == 200
