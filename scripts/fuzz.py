#!/usr/bin/env python
"""Differential fuzzing of the fusion on random CNN graphs.

    python scripts/fuzz.py --graphs 2000 --seed 0 --max-layers 8 --jobs 2 --keep-failures fuzz-failures

For each seed ``S`` in ``[seed, seed + graphs)`` the graph ``random_cnn(S, max_layers=K[, blocks=...])``
with inputs ``random_inputs(model, S)`` goes through
:func:`tvm_layerfuse.testing.differential.check_case`:

``--stages`` chooses the checks (default all but ``tactics``; ``--stages unfused,tactics`` checks
the oneDNN tactic choice, Winograd on every layer oneDNN has it for, against onnxruntime):

* plan invariants (every original layer in exactly one second-graph layer, outputs kept,
  no in-place overwrite of a tensor read later or living in a concat block);
* the plan realised as ONNX (``onnx_realize.realize``) vs onnxruntime;
* unfused TVM vs onnxruntime; fused TVM built with TVM's default pipeline, and built with
  ``layerfuse_pipeline`` (in-place concat and split-output lowering: what ``compile``
  builds), each vs onnxruntime and vs unfused TVM
  (``max|a-b| / max(max|a|, M/10) <= 1e-4``, see the differential module for M).

``--blocks parallel,concat,residual`` focuses on horizontal merges, in-place concats and
element-wise epilogues (rare in the default mix: ~4 %, 9 % and 15 % of graphs).

Every graph runs in a worker process; a worker that dies (a segfault in TVM) or takes
longer than ``--timeout`` is recorded as a ``worker-crash`` / ``timeout`` disagreement and
replaced. With ``--keep-failures DIR`` each disagreement is saved as
``DIR/seed<S>-<kind>/``: ``original.onnx`` + ``original_feeds.npz``, the delta-debugged
``reduced.onnx`` + ``reduced_feeds.npz``, and ``finding.json`` (seed, kind, details,
the command that reproduces it). ``--replay DIR/seed<S>-<kind>/reduced.onnx`` re-checks a
saved reproducer.

Prints a summary: graphs run, disagreements by kind, refusals, time, graphs per minute.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# ---------------------------------------------------------------------- worker side
def _worker(tasks, results, options) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops the workers
    os.environ.setdefault("TVM_NUM_THREADS", "1")
    import logging

    logging.basicConfig(level=logging.ERROR)
    from tvm_layerfuse.testing.differential import check_case, reduce_case, same_kind
    from tvm_layerfuse.testing.graphgen import random_cnn_case

    while True:
        seed = tasks.get()
        if seed is None:
            return
        results.put(("start", seed, os.getpid()))
        t = time.perf_counter()
        try:
            model, feeds = random_cnn_case(seed, **options["graph"])
            res = check_case(model, feeds, stages=options["stages"])
            record = {
                "seed": seed,
                "kinds": res.kinds,
                "findings": [f.to_dict() for f in res.findings],
                "refused": res.refused,
                "errors": res.errors,
                "plain_errors": res.plain_errors,
                "timings": res.timings,
                "nodes": len(model.graph.node),
            }
            if res.findings and options["keep"]:
                record["saved"] = _save(model, feeds, res, seed, options, reduce_case, same_kind)
        except Exception as e:  # the harness itself failed: report, keep going
            record = {"seed": seed, "kinds": ["harness-error"], "findings": [{"kind": "harness-error", "detail": repr(e)}]}
        record["seconds"] = round(time.perf_counter() - t, 3)
        results.put(("done", seed, record))


def _save(model, feeds, res, seed, options, reduce_case, same_kind) -> list[str]:
    import numpy as np
    import onnx

    saved = []
    for kind in res.kinds:
        d = Path(options["keep"]) / f"seed{seed}-{kind}"
        d.mkdir(parents=True, exist_ok=True)
        onnx.save(model, str(d / "original.onnx"))
        np.savez(d / "original_feeds.npz", **feeds)
        t = time.perf_counter()
        reduced, rfeeds, calls = reduce_case(model, feeds, same_kind(kind, stages=options["stages"]), budget_s=options["reduce_budget"])
        onnx.save(reduced, str(d / "reduced.onnx"))
        np.savez(d / "reduced_feeds.npz", **rfeeds)
        info = {
            "seed": seed,
            "kind": kind,
            "graph_options": options["graph"],
            "findings": [f.to_dict() for f in res.findings if f.kind == kind],
            "nodes_original": len(model.graph.node),
            "nodes_reduced": len(reduced.graph.node),
            "reduction": {"predicate_calls": calls, "seconds": round(time.perf_counter() - t, 1)},
            "reproduce": f"python scripts/fuzz.py --graphs 1 --seed {seed} --max-layers {options['graph']['max_layers']}"
            + (f" --blocks {','.join(options['graph']['blocks'])}" if "blocks" in options["graph"] else "")
            + f" --stages {','.join(options['stages'])}",
            "replay": f"python scripts/fuzz.py --replay {d / 'reduced.onnx'} --stages {','.join(options['stages'])}",
        }
        (d / "finding.json").write_text(json.dumps(info, indent=1) + "\n")
        saved.append(str(d))
    return saved


def _save_unreduced(rec: dict, options: dict) -> str:
    """A graph that killed its worker (or hung) cannot be reduced in-process: save it as is."""
    import numpy as np
    import onnx

    from tvm_layerfuse.testing.graphgen import random_cnn_case

    seed, kind = rec["seed"], rec["kinds"][0]
    d = Path(options["keep"]) / f"seed{seed}-{kind}"
    d.mkdir(parents=True, exist_ok=True)
    model, feeds = random_cnn_case(seed, **options["graph"])
    onnx.save(model, str(d / "original.onnx"))
    np.savez(d / "original_feeds.npz", **feeds)
    info = {"seed": seed, "kind": kind, "graph_options": options["graph"], "findings": rec["findings"],
            "replay": f"python scripts/fuzz.py --replay {d / 'original.onnx'}"}  # fmt: skip
    (d / "finding.json").write_text(json.dumps(info, indent=1, default=list) + "\n")
    return str(d)


# ---------------------------------------------------------------------- parent side
class Pool:
    """J worker processes; a dead or stuck worker is recorded against its seed and replaced."""

    def __init__(self, jobs: int, options: dict, timeout: float) -> None:
        self.ctx = mp.get_context("spawn")
        self.options = options
        self.timeout = timeout
        self.results = self.ctx.Queue()
        self.workers: dict[int, dict] = {}  # pid -> {proc, tasks, seed, since}
        for _ in range(jobs):
            self._spawn()

    def _spawn(self) -> None:
        tasks = self.ctx.Queue()
        proc = self.ctx.Process(target=_worker, args=(tasks, self.results, self.options), daemon=True)
        proc.start()
        self.workers[proc.pid] = {"proc": proc, "tasks": tasks, "seed": None, "since": None, "queued": 0}

    def idle(self) -> list[int]:
        return [pid for pid, w in self.workers.items() if w["queued"] == 0]

    def submit(self, pid: int, seed: int) -> None:
        w = self.workers[pid]
        w["queued"] += 1
        w["tasks"].put(seed)
        w["seed"], w["since"] = seed, time.monotonic()

    def collect(self, wait: float = 0.5):
        """Finished records, plus records for workers that died or timed out."""
        out = []
        try:
            while True:
                msg = self.results.get(timeout=wait)
                wait = 0.0
                kind, seed, payload = msg
                if kind == "start":
                    w = self.workers.get(payload)
                    if w is not None:
                        w["since"] = time.monotonic()
                else:
                    for w in self.workers.values():
                        if w["seed"] == seed and w["queued"]:
                            w["queued"] -= 1
                            w["seed"] = None
                            break
                    out.append(payload)
        except queue.Empty:
            pass
        now = time.monotonic()
        for pid, w in list(self.workers.items()):
            dead = not w["proc"].is_alive()
            stuck = w["queued"] and w["since"] is not None and now - w["since"] > self.timeout
            if (dead or stuck) and w["queued"]:
                if stuck and not dead:
                    w["proc"].kill()
                w["proc"].join(5)
                kind = "timeout" if stuck and not dead else "worker-crash"
                detail = (
                    f"no result after {self.timeout:g} s" if kind == "timeout" else f"worker exited with {w['proc'].exitcode}"
                )
                out.append({"seed": w["seed"], "kinds": [kind], "findings": [{"kind": kind, "detail": detail}]})
                del self.workers[pid]
                self._spawn()
            elif dead:
                del self.workers[pid]
                self._spawn()
        return out

    def close(self, *, wait: float = 10.0) -> None:
        for w in self.workers.values():
            w["tasks"].put(None)
        for w in self.workers.values():
            w["proc"].join(wait)
            if w["proc"].is_alive():
                w["proc"].kill()
                w["proc"].join(5)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def fuzz(args) -> int:
    from tqdm import tqdm

    # A background job started from a script ignores SIGINT: make both SIGINT and SIGTERM
    # stop the run with a summary of what finished.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)

    graph = {"max_layers": args.max_layers}
    if args.blocks:
        graph["blocks"] = tuple(args.blocks.split(","))
    options = {"graph": graph, "keep": args.keep_failures, "reduce_budget": args.reduce_budget, "stages": args.stages}
    seeds = list(range(args.seed, args.seed + args.graphs))
    pending = collections.deque(seeds)
    records: list[dict] = []
    t0 = time.perf_counter()
    pool = Pool(args.jobs, options, args.timeout)
    log = open(args.log, "a") if args.log else None
    bar = tqdm(total=len(seeds), unit="graph", dynamic_ncols=True, file=sys.stderr)
    by_kind: collections.Counter = collections.Counter()
    interrupted = False
    try:
        while len(records) < len(seeds):
            for pid in pool.idle():
                if pending:
                    pool.submit(pid, pending.popleft())
            for rec in pool.collect():
                if rec["kinds"] and rec["kinds"][0] in ("worker-crash", "timeout") and args.keep_failures:
                    rec["saved"] = [_save_unreduced(rec, options)]
                records.append(rec)
                by_kind.update(rec["kinds"])
                if log:
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
                if rec["kinds"]:
                    tqdm.write(f"seed {rec['seed']}: {', '.join(rec['kinds'])}: {rec['findings'][0]['detail'][:200]}", file=sys.stderr)
                bar.update(1)
                bar.set_postfix(disagree=sum(1 for r in records if r["kinds"]), refused=sum(1 for r in records if r.get("refused")))
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted; summary of the graphs finished so far:", file=sys.stderr)
    finally:
        bar.close()
        pool.close(wait=0.0 if interrupted else 10.0)
        if log:
            log.close()
    elapsed = time.perf_counter() - t0
    _summary(args, records, by_kind, elapsed)
    return 1 if any(r["kinds"] for r in records) else 0


def _summary(args, records, by_kind, elapsed) -> None:
    bad = [r for r in records if r["kinds"]]
    refused = collections.Counter(r["refused"].split(":")[0] for r in records if r.get("refused"))
    worst: dict[str, float] = {}
    for r in records:
        for stage, e in (r.get("errors") or {}).items():
            worst[stage] = max(worst.get(stage, 0.0), e)
    print(f"command: python {' '.join(sys.argv)}")
    done = sorted(r["seed"] for r in records)
    span = f"seeds {done[0]}..{done[-1]}" if done else "no seeds"
    blocks = f", blocks {args.blocks}" if args.blocks else ""
    print(f"graphs run: {len(records)} of {args.graphs} ({span}, max layers {args.max_layers}{blocks}, jobs {args.jobs})")
    print(f"time: {elapsed:.1f} s, {60 * len(records) / max(elapsed, 1e-9):.1f} graphs/minute")
    print(f"graphs with disagreements: {len(bad)}")
    for kind, n in sorted(by_kind.items()):
        seeds = [r["seed"] for r in bad if kind in r["kinds"]][:10]
        print(f"  {kind}: {n} (seeds {seeds}{' ...' if n > 10 else ''})")
    if refused:
        print(f"fused build refused with a clear error: {sum(refused.values())} ({dict(refused)})")
    if worst:
        print("worst error per comparison (rule: <= 1e-4): " + ", ".join(f"{k} {v:.2g}" for k, v in sorted(worst.items())))
        floor = [r["seed"] for r in records if any(v > 1e-4 for v in (r.get("plain_errors") or {}).values())]
        print(f"graphs that pass only through the near-zero floor (plain max|a-b|/max|a| > 1e-4): {len(floor)} {floor[:10]}")
    if args.keep_failures and bad:
        print(f"reproducers in {args.keep_failures}/seed<S>-<kind>/ (original.onnx, reduced.onnx, finding.json)")


def replay(path: Path, stages: tuple) -> int:
    import numpy as np
    import onnx

    from tvm_layerfuse.testing.differential import check_case

    model = onnx.load(str(path))
    feeds_path = path.with_name(path.stem + "_feeds.npz")
    with np.load(feeds_path, allow_pickle=False) as data:
        feeds = {k: data[k] for k in data.files}
    res = check_case(model, feeds, stages=stages)
    for f in res.findings:
        print(f"{f.kind}: {f.detail}")
    print(f"errors: {res.errors}; refused: {res.refused}")
    return 1 if res.findings else 0


def main(argv=None) -> int:
    # a merge the plan decided and the Relax passes did not carry out is a finding (fused-crash)
    os.environ.setdefault("TVM_LAYERFUSE_STRICT_PLAN", "1")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graphs", type=int, default=100, help="number of graphs (seeds seed .. seed+graphs-1)")
    ap.add_argument("--seed", type=int, default=0, help="first seed")
    ap.add_argument("--max-layers", type=int, default=8, help="graph size bound (random_cnn's max_layers)")
    ap.add_argument(
        "--blocks",
        help="comma-separated block kinds to draw from (graphgen.ALL_BLOCKS; default graphgen.BLOCKS: all but "
        "'exporter', the exporters' shape arithmetic and heads)",
    )
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    ap.add_argument("--keep-failures", metavar="DIR", help="save each disagreement with a delta-debugged reproducer")
    ap.add_argument("--reduce-budget", type=float, default=180.0, help="seconds of delta debugging per disagreement")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per graph (reduction included) before it counts as stuck")
    ap.add_argument("--log", metavar="FILE.jsonl", help="append one JSON record per graph")
    ap.add_argument("--replay", metavar="MODEL.onnx", help="re-check a saved reproducer (its _feeds.npz beside it)")
    ap.add_argument(
        "--stages",
        default="plan,realize,unfused,fused,lowered",
        help="comma-separated stages to check (differential.ALL_STAGES; add 'tactics' for the oneDNN tactic)",
    )
    args = ap.parse_args(argv)
    from tvm_layerfuse.testing.differential import ALL_STAGES

    unknown = [x for x in args.stages.split(",") if x not in ALL_STAGES]
    if unknown:
        ap.error(f"--stages {args.stages}: unknown {unknown}; expected some of {','.join(ALL_STAGES)}")
    args.stages = tuple(args.stages.split(","))
    if args.replay:
        return replay(Path(args.replay), args.stages)
    if args.graphs < 1 or args.jobs < 1:
        ap.error("--graphs and --jobs must be >= 1")
    if args.blocks:
        from tvm_layerfuse.testing.graphgen import ALL_BLOCKS as BLOCKS

        unknown = [b for b in args.blocks.split(",") if b not in BLOCKS]
        if unknown:
            ap.error(f"--blocks {args.blocks}: unknown {unknown}; expected some of {','.join(BLOCKS)}")
    return fuzz(args)


if __name__ == "__main__":
    sys.exit(main())
