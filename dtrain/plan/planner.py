"""The parallelism planner: every layout of a model on a cluster, its predicted memory and step
time, ranked, with the reason each one wins or is excluded; and where a given layout (a
recipe's, or a ``--layout`` string: ``dtrain.plan.given``) ranks, and why.

``python -m dtrain.plan --model llama3_70b --gpus 64 --gpus-per-node 8 --gpu-memory-gb 80
--seq-len 4096 --global-batch 1024``; ``python -m dtrain.plan --recipe llama3_70b``
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field, replace

from dtrain.config import ConfigError
from dtrain.models import model_args
from dtrain.models.presets import PRESETS
from dtrain.plan.constants import H200, Constants
from dtrain.plan.given import LAYOUT_HELP, Given, given_layout
from dtrain.plan.memory import GIB, Layout, MemoryEstimate, Workload, estimate_memory
from dtrain.plan.step_time import TimeEstimate, estimate_time

AC_MODES = ("none", "op", "full")
NO_DEFAULT = "%(default).0s"  # argparse: no "(default: None)" after this help


@dataclass
class Candidate:
    """A layout with its predictions; ``excluded`` says why it cannot run ("" if it can)."""
    layout: Layout
    memory: MemoryEstimate
    time: TimeEstimate
    excluded: str = ""
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def layouts(work: Workload, cluster: Cluster, like: Layout | None = None) -> list[Layout]:
    """Every layout the trainer accepts for this model, batch and cluster size (degrees that
    divide, sequence and heads divisible, at least pp microbatches), with micro-batch,
    checkpointing and pipeline-schedule choices; compile, FP8 and the CP exchange as in
    ``like``. TP across nodes is listed (and excluded later with its reason)."""
    args, seq, gpus = work.args, work.seq_len, cluster.gpus
    like = like or Layout()
    out = []
    for tp in _powers_of_two(min(gpus, 16)):
        if args.n_heads % tp or args.kv_heads % tp or seq % tp:
            continue
        for pp in _divisors(gpus // tp):
            if pp > args.n_layers or pp > 16:
                continue
            for cp in _powers_of_two(gpus // (tp * pp)):
                if cp > 8 or seq % (2 * cp * tp) or (cp > 1 and seq < 16384 and cp > 2):
                    continue
                dp = gpus // (tp * pp * cp)
                for dp_replicate in {1, max(1, dp // max(1, cluster.gpus_per_node // (tp * cp)))}:
                    if dp % dp_replicate:
                        continue
                    dp_shard = dp // dp_replicate
                    for ep in (_divisors(args.n_experts) if args.n_experts else [1]):
                        if (dp_shard * cp) % ep or (ep > 1 and cp > 1 and ep % cp):
                            continue
                        if args.n_experts and tp > 1 and ep == 1:
                            continue
                        out += _batch_choices(work, replace(like, tp=tp, pp=pp, cp=cp, ep=ep,
                                                            dp_shard=dp_shard,
                                                            dp_replicate=dp_replicate), like)
    return out


def virtual_stages(n_layers: int, pp: int) -> list[int]:
    """Stages per rank to try with an interleaved schedule: every count that splits the layers
    evenly over ``pp x v`` stages, and 2, 3 and 4 also when the split is uneven (dtrain's
    pipeline gives the earlier stages the remainder); at least one layer per stage."""
    return [v for v in range(2, n_layers // pp + 1)
            if n_layers % (pp * v) == 0 or v <= 4]


def _batch_choices(work: Workload, base: Layout, like: Layout) -> list[Layout]:
    """Micro-batch, schedule and checkpointing variants of ``base``; the stages' layers as in
    ``like`` where the stages are its (pp and stages per rank), else split evenly."""
    out = []
    for mb in (1, 2, 4, 8):
        if work.global_batch % (mb * base.dp):
            continue
        m = work.global_batch // (mb * base.dp)
        schedules = [("1F1B", 1)]
        if base.pp > 1:
            if m < base.pp:
                continue
            if m % base.pp == 0:  # dtrain.parallel.pipeline.check_pipeline
                schedules += [("Interleaved1F1B", v)
                              for v in virtual_stages(work.args.n_layers, base.pp)]
        for schedule, v in schedules:
            same_stages = (base.pp, v) == (like.pp, like.pp_virtual_stages)
            for ac in AC_MODES if base.ep == 1 else ("none", "full"):  # op refused with ep
                out.append(replace(base, micro_batch=mb, ac=ac, pp_schedule=schedule,
                                   pp_virtual_stages=v,
                                   pp_layout=like.pp_layout if same_stages else ""))
    return out


def evaluate(work: Workload, layout: Layout, cluster: Cluster,
             c: Constants = H200) -> Candidate:
    """Predictions for one layout and, when it cannot run well, why."""
    mem = estimate_memory(work, layout, c)
    time = estimate_time(work, layout, cluster.gpus_per_node, c)
    cand = Candidate(layout, mem, time)
    budget = cluster.gpu_memory_gb * 1e9 * c.usable_memory
    if layout.tp > cluster.gpus_per_node:
        cand.excluded = f"TP {layout.tp} across nodes (more than {cluster.gpus_per_node} GPUs)"
    elif mem.peak > budget:
        cand.excluded = (f"memory over budget: {mem.peak / GIB:.1f} GiB > "
                         f"{budget / GIB:.1f} GiB usable")
    elif layout.pp > 1 and time.bubble > 0.15 * time.step:
        cand.excluded = f"pipeline bubble {100 * time.bubble / time.step:.0f}% of the step"
    return cand


def plan(work: Workload, cluster: Cluster, c: Constants = H200) -> list[Candidate]:
    """Every layout evaluated: those that fit ranked by predicted step time (fastest first),
    then the excluded ones."""
    return plan_like(work, cluster, Layout(), c)


def plan_like(work: Workload, cluster: Cluster, like: Layout,
              c: Constants = H200) -> list[Candidate]:
    """``plan`` over the layouts that compile, use FP8 and exchange CP's K/V as ``like`` does."""
    cands = [evaluate(work, layout, cluster, c) for layout in layouts(work, cluster, like)]
    fits = sorted((x for x in cands if not x.excluded), key=lambda x: x.time.step)
    out = sorted((x for x in cands if x.excluded), key=lambda x: x.time.step)
    return fits + out


_PARTS = ("compute", "bubble", "fsdp", "tp", "cp", "ep", "optimizer", "overhead")


def _change(best: Candidate, other: Candidate, part: str) -> str:
    """How ``part`` of the step differs in ``other`` from ``best``, with the figures."""
    b, o, bt, ot = best.layout, other.layout, best.time, other.time
    if part == "compute":
        if o.ac != b.ac:
            return f"AC {o.ac} against {b.ac}"
        return f"compute {ot.compute:.2f} against {bt.compute:.2f} s"
    if part == "bubble":
        shares = (100 * ot.bubble / ot.step, 100 * bt.bubble / bt.step)
        return (f"pipeline bubble {shares[0]:.1f}% against {shares[1]:.1f}% (PP {o.pp} against "
                f"{b.pp}, {ot.microbatches} micro-batches)")
    if part == "fsdp":
        text = (f"FSDP/HSDP traffic {ot.traffic.get('fsdp', 0) / 1e9:,.0f} against "
                f"{bt.traffic.get('fsdp', 0) / 1e9:,.0f} GB/step")
        across = round(ot.fsdp_across_nodes / 1e9), round(bt.fsdp_across_nodes / 1e9)
        if across[0] != across[1]:
            text += f", {across[0]:,} against {across[1]:,} GB of it across nodes"
        return text
    if part in ("tp", "cp", "ep"):
        name, kind = part.upper(), {"tp": "activations", "cp": "K/V exchange",
                                    "ep": "all-to-all"}[part]
        degrees = getattr(o, part), getattr(b, part)
        volumes = ot.traffic.get(part, 0) / 1e9, bt.traffic.get(part, 0) / 1e9
        if degrees[1] == 1 < degrees[0]:
            return (f"{name} {degrees[0]} adds {volumes[0]:,.1f} GB/step of {kind} at "
                    f"{ot.bandwidth[part]:g} GB/s")
        if degrees[0] == degrees[1] and f"{volumes[0]:,.1f}" == f"{volumes[1]:,.1f}":
            return f"{name} {degrees[0]}: {volumes[0]:,.1f} GB/step of {kind}{_rates(ot, bt, part)}"
        return (f"{name} {degrees[0]} against {degrees[1]}: {volumes[0]:,.1f} against "
                f"{volumes[1]:,.1f} GB/step of {kind}{_rates(ot, bt, part)}")
    if part == "optimizer":
        return f"optimizer step {ot.optimizer:.2f} against {bt.optimizer:.2f} s"
    stages = o.pp_virtual_stages, b.pp_virtual_stages
    if stages[0] != stages[1]:
        return (f"{ot.microbatches} micro-batches x {stages[0]} stages per rank against "
                f"{bt.microbatches} x {stages[1]} of fixed overhead")
    return f"{ot.microbatches} against {bt.microbatches} micro-batches of fixed overhead"


def _rates(ot: TimeEstimate, bt: TimeEstimate, part: str) -> str:
    """The text " at 40 against 360 GB/s" when the two layouts' collectives run at different
    speeds (across nodes against inside one), else ""."""
    rates = ot.bandwidth.get(part), bt.bandwidth.get(part)
    if None in rates or rates[0] == rates[1]:
        return ""
    return f" at {rates[0]:g} against {rates[1]:g} GB/s"


def why_slower(best: Candidate, other: Candidate) -> str:
    """What ``other`` loses against ``best`` (the step-time part that grows most, with its
    figures) and, when it gains somewhere, the largest gain."""
    diffs = {p: getattr(other.time, p) - getattr(best.time, p) for p in _PARTS}
    lost = max(diffs, key=diffs.get)
    total = other.time.step - best.time.step
    text = (f"+{100 * total / best.time.step:.1f}% step time: "
            f"{_change(best, other, lost)} (+{diffs[lost]:.2f} s)")
    gained = min(diffs, key=diffs.get)
    if diffs[gained] < -0.005:
        text += f"; {_change(best, other, gained)} ({diffs[gained]:.2f} s)"
    return text


def format_plan(cands: list[Candidate], work: Workload, cluster: Cluster, top: int = 10) -> str:
    fits = [x for x in cands if not x.excluded]
    lines = [f"{cluster.gpus} GPUs ({cluster.gpus_per_node} per node, {cluster.gpu_memory_gb:g} "
             f"GB), seq {work.seq_len}, global batch {work.global_batch} sequences: "
             f"{len(cands)} layouts, {len(fits)} fit"]
    header = (f"{'#':>3} {'layout':<84} {'step s':>7} {'tok/s/GPU':>9} {'MFU':>6} "
              f"{'mem GiB':>7}  why")
    lines += [header, "-" * len(header)]
    for i, cand in enumerate(fits[:top]):
        reason = "fastest that fits" if i == 0 else why_slower(fits[0], cand)
        lines.append(_row(i + 1, cand, reason))
    excluded = [x for x in cands if x.excluded]
    shown = {}
    for cand in excluded:  # the fastest excluded layout of each kind of reason
        kind = cand.excluded.split(":")[0].split(" ")[0]
        if kind not in shown:
            shown[kind] = cand
    if shown:
        lines.append("excluded (the fastest of each reason):")
        for cand in shown.values():
            lines.append(_row(0, cand, "excluded: " + cand.excluded))
    return "\n".join(lines)


def _row(rank: int, cand: Candidate, reason: str) -> str:
    t, m = cand.time, cand.memory
    return (f"{rank or '-':>3} {cand.layout.describe():<84} {t.step:7.2f} "
            f"{t.tokens_per_second:9,.0f} {100 * t.mfu:5.1f}% {m.peak / GIB:7.1f}  {reason}")


def format_given(cands: list[Candidate], given: Candidate, label: str) -> str:
    """Where ``given`` (a layout the user runs) ranks among the layouts that fit in ``cands``:
    its row, its step-time gap to the fastest and why, or why it is excluded."""
    fits = [x for x in cands if not x.excluded]
    rank = 1 + sum(x.time.step < given.time.step for x in fits)
    gap = 100 * (given.time.step / fits[0].time.step - 1) if fits else 0.0
    if given.excluded:
        head = (f"{label}: excluded ({given.excluded}); by step time alone it would rank "
                f"{rank} of the {len(fits)} that fit, {gap:+.1f}% against #1")
        reason = "excluded: " + given.excluded
    else:
        head = (f"{label}: rank {rank} of the {len(fits)} layouts that fit, {gap:+.1f}% step "
                "time against #1")
        reason = "fastest that fits" if rank == 1 else why_slower(fits[0], given)
    return "\n".join([head, _row(0 if given.excluded else rank, given, reason)])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dtrain.plan", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Rank the parallel layouts of a model on a cluster by predicted step time, "
                    "with predicted memory per GPU and MFU (no GPU needed); with --recipe or "
                    "--layout, also where that layout ranks and why.")
    parser.add_argument("--recipe", help="a shipped recipe name or a .toml path: its model, "
                        "sequence, batch, layout, checkpointing, compile and FP8 (loaded as "
                        "the trainer loads it), scored and ranked" + NO_DEFAULT)
    parser.add_argument("--layout", help=LAYOUT_HELP + NO_DEFAULT)
    parser.add_argument("--model", help=f"preset (without --recipe): {', '.join(PRESETS)}"
                        + NO_DEFAULT)
    parser.add_argument("--gpus", type=int, help="GPUs in the whole job (with --recipe or "
                        "--layout: the product of the degrees unless dp_shard is -1)"
                        + NO_DEFAULT)
    parser.add_argument("--gpus-per-node", type=int, default=8,
                        help="GPUs per machine (NVLink inside, the network between)")
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0,
                        help="memory of one GPU; a layout whose predicted peak exceeds its "
                             "usable part is excluded")
    parser.add_argument("--seq-len", type=int,
                        help="tokens per sequence (default: the recipe's, else 8192)"
                        + NO_DEFAULT)
    parser.add_argument("--global-batch", type=int,
                        help="sequences per optimizer step (default: the recipe's)"
                        + NO_DEFAULT)
    parser.add_argument("--top", type=int, default=10, help="layouts to print")
    parser.add_argument("--network-gb-s", type=float, default=H200.network_gb_s,
                        help="achieved bus bandwidth of collectives across nodes, GB/s per GPU "
                             "(an assumption: 400 Gb/s InfiniBand per GPU; measure yours with "
                             "nccl-tests' all_reduce_perf across two nodes)")
    parser.add_argument("--nvlink-gb-s", type=float, default=H200.nvlink_gb_s,
                        help="the same inside a node, GB/s per GPU")
    return parser


def _workload(args: argparse.Namespace) -> tuple[Workload, int, Given | None]:
    """(workload, GPUs, the given layout or None) from the command line. Raises ConfigError."""
    if args.recipe and args.model:
        raise ConfigError("--model and --recipe both given: the recipe names its model; drop "
                          "--model (or --recipe)")
    if not args.recipe and not args.model:
        raise ConfigError("give --model NAME (with --gpus and --global-batch) or --recipe NAME")
    if args.model and args.model not in PRESETS:
        raise ConfigError(f"unknown model '{args.model}': use one of {', '.join(PRESETS)}")
    missing = [flag for flag, value in (("--gpus", args.gpus or args.layout),
                                        ("--global-batch", args.global_batch)) if not value]
    if args.model and missing:
        raise ConfigError(f"--model needs {' and '.join(missing)} (or use --recipe NAME)")
    if args.recipe or args.layout:
        seq_len = args.seq_len or (None if args.recipe else 8192)
        given = given_layout(args.recipe, args.layout, args.model, args.gpus, seq_len,
                             args.global_batch)
        return given.work, given.gpus, given
    return Workload(model_args(args.model), args.seq_len or 8192, args.global_batch), \
        args.gpus, None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        work, gpus, given = _workload(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cluster = Cluster(gpus, args.gpus_per_node, args.gpu_memory_gb)
    c = replace(H200, network_gb_s=args.network_gb_s, nvlink_gb_s=args.nvlink_gb_s)
    cands = plan_like(work, cluster, given.layout if given else Layout(), c)
    print(format_plan(cands, work, cluster, args.top))
    if given:
        print(format_given(cands, evaluate(work, given.layout, cluster, c), given.label))
    if not any(not x.excluded for x in cands):
        print("error: no layout fits: use more GPUs, a shorter sequence or a smaller batch",
              file=sys.stderr)
        return 2
    return 0
