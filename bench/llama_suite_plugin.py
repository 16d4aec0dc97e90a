"""pytest plugin for llama.cpp's server tests (tools/server/tests) as bench/llama_suite.py runs
them: every model the suite would fetch from Hugging Face becomes the local Gemma 3 270M GGUF,
nothing is downloaded, and the tests that need the network or a model Gemma cannot stand in for
are deselected (DESELECT: each with its reason).

Loaded with ``-p llama_suite_plugin`` (bench/ on PYTHONPATH) from a copy of the tests directory;
it changes no file. The model path comes from HYDRA_SUITE_MODEL.
"""

from __future__ import annotations

import fnmatch
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

MODEL_ENV = "HYDRA_SUITE_MODEL"

# Downloads that are a model Gemma can stand in for (test_speculative's draft model: a draft
# with the main model's vocabulary, which Gemma as its own draft has).
STAND_IN_URLS = (
    "https://huggingface.co/ggml-org/tiny-llamas/resolve/main/stories15M-q4_0.gguf",
)

_NET = "needs the network (Hugging Face / example.com; this box is offline)"
_VISION = "needs tinygemma3's vision projector (mmproj) and test images from Hugging Face"
_ROUTER_HF = ("llama-server's multi-model router mode loading Hugging Face models by name "
              "(ggml-org/tinygemma3-GGUF, test-model-stories260K) from the network")

# (nodeid pattern, fnmatch, relative to the tests dir) -> why it is not run.
DESELECT: tuple[tuple[str, str], ...] = (
    ("unit/test_embedding.py::*",
     "embedding model (bert-bge-small): asserts embedding sizes/values a causal LM cannot give"),
    ("unit/test_metrics.py::test_metrics_embedding_prompt_is_counted",
     "embedding model preset (bert-bge-small)"),
    ("unit/test_rerank.py::*", "reranking model (jina-reranker): Gemma has no rerank head"),
    ("unit/test_vision_api.py::*", _VISION),
    ("unit/test_compat_anthropic.py::test_anthropic_vision_base64_with_multimodal_model",
     _VISION),
    ("unit/test_slot_save.py::test_slot_save_restore_text_only_on_multimodal", _VISION),
    ("unit/test_slot_save.py::test_slot_save_restore_with_image", _VISION),
    ("unit/test_slot_save.py::test_slot_save_restore_with_two_images", _VISION),
    ("unit/test_slot_save.py::test_slot_save_restore_with_image_across_restart", _VISION),
    ("unit/test_slot_save.py::test_slot_save_restore_image_payload_larger_than_context",
     _VISION),
    ("unit/test_slot_save.py::test_slot_restore_media_file_without_mmproj", _VISION),
    ("unit/test_security.py::test_local_media_file*", _VISION),
    ("unit/test_systemone.py::*",
     "a decision model (tinylaya, tinyopenjev with mmproj): with Gemma llama-server answers 501 "
     "'This model is not a decision model' before anything else is checked"),
    ("unit/test_infill.py::*",
     "infill needs a model with FIM tokens (stories260K-infill); Gemma 3 has none: 501 'Infill "
     "is not supported by this model' before the request is validated"),
    ("unit/test_lora.py::*",
     "LoRA adapters trained for stories15M, downloaded from Hugging Face: none fits Gemma"),
    ("unit/test_basic.py::test_load_split_model",
     "a split (3-file) GGUF from Hugging Face: Gemma is one file"),
    ("unit/test_proxy.py::test_mcp_proxy", "fetches http://example.com through /cors-proxy: "
     + _NET),
    ("unit/test_router.py::test_router_chat_completion_stream[[]ggml-org/*", _ROUTER_HF),
    ("unit/test_router.py::test_router_unload_model", _ROUTER_HF),
    ("unit/test_router.py::test_router_models_max_evicts_lru", _ROUTER_HF),
    ("unit/test_router.py::test_router_queue_*", _ROUTER_HF),
    ("unit/test_router.py::test_router_no_models_autoload", _ROUTER_HF),
    ("unit/test_router.py::test_router_api_key_required", _ROUTER_HF),
    ("unit/test_router.py::test_router_dedup_cache_models", _ROUTER_HF),
    ("unit/test_router.py::test_router_remote_preset", _ROUTER_HF),
    ("unit/test_router.py::test_router_download_model", _ROUTER_HF),
    ("unit/test_router.py::test_router_delete_model", _ROUTER_HF),
    ("unit/test_stream.py::*", _ROUTER_HF),
)


def deselect_reason(nodeid: str) -> str | None:
    for pattern, reason in DESELECT:
        if fnmatch.fnmatchcase(nodeid, pattern):
            return reason
    return None


def _patch(utils: Any, model: str) -> None:
    """Presets keep their settings (context, slots, batch, sampling); only the model changes."""
    utils.ServerPreset.load_all = staticmethod(lambda: None)  # it would download every preset

    original_start: Callable[..., None] = utils.ServerProcess.start

    def start(self: Any, *args: Any, **kwargs: Any) -> None:
        if self.model_hf_repo or self.model_hf_file or self.model_url:
            self.model_file = model
            self.model_hf_repo = self.model_hf_file = self.model_url = None
        original_start(self, *args, **kwargs)

    utils.ServerProcess.start = start

    original_download: Callable[..., str] = utils.download_file

    def download_file(url: str, output_file_path: str | None = None) -> str:
        if url in STAND_IN_URLS:
            return model
        return original_download(url, output_file_path)

    utils.download_file = download_file


def pytest_configure(config: pytest.Config) -> None:
    model = os.environ.get(MODEL_ENV)
    if not model or not Path(model).is_file():
        raise pytest.UsageError(f"{MODEL_ENV} must name the Gemma GGUF (got {model!r})")
    tests_dir = str(config.rootpath)
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    import utils  # the suite's own helpers (tools/server/tests/utils.py)

    _patch(utils, model)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        (dropped if deselect_reason(item.nodeid) else keep).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
