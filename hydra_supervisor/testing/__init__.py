"""Stand-ins and harnesses shared by the tests (tests/) and the bench scripts (bench/): a real
`hydra up` driver and isolated environments (harness), network namespaces as hosts (netns),
raw HTTP/1.1 clients and bursts (front_door), fake upstreams and llama.cpp processes for the
router (routerhelp), a llama-server on a synthetic model (synthhelp), a byte-counting relay in
front of ggml-rpc-server (rpcrelay), the fault-injection scenarios (faults) and background
OpenAI clients (load).

The top layer: nothing else in hydra_supervisor imports it (checked by tests/test_layers.py),
so the serving code never depends on a test stand-in. Its modules may import pytest, requests
and openai (the `dev` extra).
"""
