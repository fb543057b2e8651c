"""Where device time goes in a Chrome trace from torch.profiler, and how two traces differ.

    python tools/trace_summary.py TRACE.json[.gz] [--steps N]
    python tools/trace_summary.py A.json B.json --steps 2 1 --labels dtrain torchtitan

Per traced step and for the trace's (lowest-numbered) GPU it gives: the traced wall span, the
time some compute kernel ran (the union of non-NCCL kernels), the compute-idle time and its
largest gaps, NCCL time by collective, kernel time by category (matmul, attention, fused Triton,
FSDP copies, optimizer, other) and the top kernels. Several traces are set side by side. Works on
the traces ``tools/bench.py --profile`` writes and on torchtitan's.

``--gaps N`` says where the idle time comes from: each compute gap over 50 us is charged to the host
ops that launched the kernel ending it (the three innermost around its launch), and counted as
"after a host sync" when the host sat in a synchronising CUDA call as the device ran dry; the N
largest such sources are listed.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

CATEGORIES = [  # first match wins
    ("nccl", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"cudnn|flash|fmha|attn|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|wgmma|sm90_|scaled_mm", re.I)),
    ("fsdp copy", re.compile(r"foreach_copy|chunk_cat|split_with_sizes|CatArrayBatched", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor_apply|foreach", re.I)),
    ("fused triton", re.compile(r"^triton_")),
    ("copy/fill", re.compile(r"copy|fill|memcpy|memset", re.I)),
]


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if pattern.search(name):
            return label
    return "other"


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def load_kernels(path: Path, events: list[dict] | None = None) -> tuple[list[dict], int]:
    """GPU kernel and memcpy/memset events of the lowest-numbered device, and the number of
    ``ProfilerStep`` annotations (0 when the trace has none)."""
    events = load_events(path) if events is None else events
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy",
                                                                          "gpu_memset")]
    devices = {e.get("args", {}).get("device", 0) for e in kernels}
    device = min(devices) if devices else 0
    kernels = [e for e in kernels if e.get("args", {}).get("device", 0) == device]
    steps = {e["name"] for e in events
             if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")}
    return kernels, len(steps)


def union_length(intervals: list[tuple[float, float]]) -> tuple[float, list[tuple[float, float]]]:
    """Total covered length of ``intervals`` and the gaps between covered stretches."""
    covered, gaps, end = 0.0, [], None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            if end is not None:
                gaps.append((end, start))
            covered += stop - start
            end = stop
        elif stop > end:
            covered += stop - end
            end = stop
    return covered, gaps


GAP_US = 50  # a gap shorter than a few launches is the launch queue's, not the host's
SKEW_US = 20  # between the host's and the device's timestamps in a trace


def gap_sources(events: list[dict], kernels: list[dict], gaps: list[tuple[float, float]]
                ) -> dict[str, list[float]]:
    """Each compute gap over ``GAP_US``, charged to the host ops that launched the kernel ending
    it: ``{ops: [gaps, idle us, gaps after a host sync]}``."""
    host = defaultdict(list)  # thread: its ops by start, the outer of two at one time first
    for e in sorted((e for e in events if e.get("ph") == "X"
                     and e.get("cat") in ("cpu_op", "user_annotation")
                     and not str(e.get("name", "")).startswith("ProfilerStep#")),
                    key=lambda e: (e["ts"], -e["dur"])):
        host[e.get("tid")].append(e)
    host_starts = {tid: [e["ts"] for e in ops] for tid, ops in host.items()}
    runtime = [e for e in events if e.get("ph") == "X"
               and e.get("cat") in ("cuda_runtime", "cuda_driver")]
    launches = {e["args"]["correlation"]: e for e in runtime if "correlation" in e.get("args", {})}
    syncs = [e for e in runtime if "Synchronize" in e["name"]]
    starts = {e["ts"]: e for e in kernels if category(e["name"]) != "nccl"}
    sources: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])
    for a, b in gaps:
        if b - a <= GAP_US:
            continue
        launch = launches.get(starts[b].get("args", {}).get("correlation")) if b in starts else None
        if launch is None:
            ops = "(launch not in the trace)"
        else:
            # back from the launch, the innermost three ops still running at it
            ops_of, around = host.get(launch.get("tid"), []), []
            i = bisect.bisect_right(host_starts.get(launch.get("tid"), []), launch["ts"])
            while i > 0 and len(around) < 3:
                i -= 1
                if ops_of[i]["ts"] + ops_of[i]["dur"] >= launch["ts"]:
                    around.append(ops_of[i]["name"][:60])
            ops = " < ".join(around) or "(no host op)"
        entry = sources[ops]
        entry[0] += 1
        entry[1] += b - a
        # the host waited from before the device ran dry until about then (the two clocks
        # differ by a few microseconds)
        entry[2] += any(e["ts"] <= a and a - SKEW_US <= e["ts"] + e["dur"] <= b for e in syncs)
    return sources


def summarize(path: Path, steps: int | None = None) -> dict:
    events = load_events(path)
    kernels, traced_steps = load_kernels(path, events)
    steps = steps or traced_steps or 1
    if not kernels:
        raise SystemExit(f"{path}: no GPU kernels in the trace (was CUDA activity recorded?)")
    start = min(e["ts"] for e in kernels)
    stop = max(e["ts"] + e["dur"] for e in kernels)
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if category(e["name"]) != "nccl"]
    busy, gaps = union_length(compute)
    by_category, by_kernel, nccl = defaultdict(float), defaultdict(lambda: [0, 0.0]), \
        defaultdict(float)
    for e in kernels:
        cat = category(e["name"])
        by_category[cat] += e["dur"]
        entry = by_kernel[e["name"][:90]]
        entry[0] += 1
        entry[1] += e["dur"]
        if cat == "nccl":
            kind = re.search(r"AllGather|ReduceScatter|AllReduce|SendRecv|Broadcast|AllToAll",
                             e["name"])
            nccl[kind.group(0) if kind else "other"] += e["dur"]
    ms = 1e3 * steps  # trace times are microseconds: per-step milliseconds
    return {
        "path": str(path), "steps": steps,
        "span_ms": (stop - start) / ms,
        "compute_busy_ms": busy / ms,
        "compute_idle_ms": (stop - start - busy) / ms,
        "largest_gaps_ms": sorted(((b - a) / 1e3 for a, b in gaps), reverse=True)[:5],
        "gaps_over_50us": sum(1 for a, b in gaps if b - a > GAP_US) / steps,
        "gap_sources": {ops: (n / steps, t / ms, synced / steps)
                        for ops, (n, t, synced) in gap_sources(events, kernels, gaps).items()},
        "categories_ms": {k: v / ms for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])},
        "nccl_ms": {k: v / ms for k, v in nccl.items()},
        "kernels": {k: (n / steps, t / ms) for k, (n, t) in by_kernel.items()},
    }


def report(summaries: list[dict], labels: list[str], top: int, sources: int = 0) -> str:
    rows = [("traced span / step (ms)", "span_ms"), ("compute busy (ms)", "compute_busy_ms"),
            ("compute idle (ms)", "compute_idle_ms"), ("gaps > 50 us / step", "gaps_over_50us")]
    width = max(12, *(len(label) for label in labels))
    lines = [f"{'':32}" + "".join(f"{label:>{width + 2}}" for label in labels)]
    for title, key in rows:
        lines.append(f"{title:32}" + "".join(f"{s[key]:>{width + 2}.1f}" for s in summaries))
    cats = sorted({c for s in summaries for c in s["categories_ms"]},
                  key=lambda c: -summaries[0]["categories_ms"].get(c, 0.0))
    for cat in cats:
        lines.append(f"{'  ' + cat + ' (ms)':32}"
                     + "".join(f"{s['categories_ms'].get(cat, 0.0):>{width + 2}.1f}"
                               for s in summaries))
    for kind in sorted({k for s in summaries for k in s["nccl_ms"]}):
        lines.append(f"{'    nccl ' + kind + ' (ms)':32}"
                     + "".join(f"{s['nccl_ms'].get(kind, 0.0):>{width + 2}.1f}" for s in summaries))
    for label, s in zip(labels, summaries, strict=True):
        gaps = ", ".join(f"{g:.2f}" for g in s["largest_gaps_ms"])
        lines.append(f"largest compute gaps, {label} (ms): {gaps}")
    if sources:
        for label, s in zip(labels, summaries, strict=True):
            lines.append(f"\nidle over {GAP_US} us by the host ops that launched the next "
                         f"kernel, {label} (per step: ms, gaps, after a host sync):")
            ranked = sorted(s["gap_sources"].items(), key=lambda kv: -kv[1][1])[:sources]
            lines += [f"  {t:8.2f} ms  x{n:<5.0f} sync x{m:<5.0f} {ops}"
                      for ops, (n, t, m) in ranked]
    # Kernel names differ between two compiled programs (Triton names carry their fusion), so
    # the comparison is by category above; below, each trace's own top kernels.
    for label, s in zip(labels, summaries, strict=True):
        lines.append(f"\ntop kernels, {label} (per step: ms, count):")
        ranked = sorted(s["kernels"].items(), key=lambda kv: -kv[1][1])[:top]
        lines += [f"  {t:8.2f} ms  x{n:<6.0f} {name}" for name, (n, t) in ranked]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--steps", nargs="*", type=int, default=[],
                        help="training steps in each trace (default: its ProfilerStep count, or 1)")
    parser.add_argument("--labels", nargs="*", default=[])
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--gaps", type=int, default=0,
                        help="list the N host sources of the largest compute idle time")
    args = parser.parse_args()
    if len(args.steps) > len(args.traces) or len(args.labels) > len(args.traces):
        parser.error("give at most one --steps value and one --labels name per trace")
    steps = args.steps + [None] * (len(args.traces) - len(args.steps))
    labels = args.labels + [p.stem for p in args.traces[len(args.labels):]]
    summaries = [summarize(path, n) for path, n in zip(args.traces, steps, strict=True)]
    print(report(summaries, labels, args.top, args.gaps))


if __name__ == "__main__":
    main()
