"""The layout a user runs, for the planner to score (``python -m dtrain.plan --recipe NAME``,
``--layout SPEC``): the workload and layout of a recipe, a layout string, or both (the string
changes the recipe's settings), checked as the trainer checks a config (``dtrain.checks``),
and where that layout ranks among every layout the planner knows.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.build import batch_arithmetic
from dtrain.checks import validate
from dtrain.config import Config, ConfigError, load_config
from dtrain.model_shape import model_args_of
from dtrain.parallel.pipeline import SINGLE_STAGE
from dtrain.plan.dry_run import layout_of
from dtrain.plan.memory import Layout, Workload

# --layout key -> the config field it sets.
LAYOUT_KEYS = {
    "tp": "parallel.tp", "pp": "parallel.pp", "cp": "parallel.cp", "ep": "parallel.ep",
    "dp_shard": "parallel.dp_shard", "dp_replicate": "parallel.dp_replicate",
    "v": "parallel.pp_virtual_stages", "schedule": "parallel.pp_schedule",
    "mb": "training.micro_batch_size", "ac": "activation_checkpoint.mode",
    "compile": "compile.enabled", "fp8": "fp8.enabled", "cp_comm": "parallel.cp_comm_type",
}

LAYOUT_HELP = (
    "a layout to score, comma-separated key=value: tp, pp, v (pipeline stages per rank; v > 1 "
    "takes Interleaved1F1B unless schedule= says otherwise), schedule, cp, ep, dp_shard (-1: "
    "the GPUs left), dp_replicate, mb (micro-batch), ac (none, op, full, layer), compile, fp8, "
    "cp_comm (p2p, all_gather, a2a); e.g. tp=4,pp=4,v=5,dp_shard=4,mb=1,ac=op. Keys left out "
    "keep the recipe's values; without --recipe, 1 for the degrees and mb, dp_shard -1, ac op, "
    "compiled, bf16. A layout the trainer would refuse is one error line (exit 2)")


@dataclass(frozen=True)
class Given:
    """A layout to score and what it trains."""
    label: str
    """Where it comes from: ``recipe llama3_70b``, ``--layout tp=4,...`` or both."""
    work: Workload
    layout: Layout
    gpus: int


def parse_layout_spec(text: str) -> dict[str, str]:
    """``"tp=4,pp=4,v=5"`` -> ``{"parallel.tp": "4", ...}`` (values still strings: the config
    loader types and checks them). Raises ConfigError for a malformed item or unknown key."""
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise ConfigError(f"--layout item '{item}' is not key=value: write e.g. "
                              "tp=4,pp=4,v=5,dp_shard=4,mb=1,ac=op")
        if key not in LAYOUT_KEYS:
            raise ConfigError(f"--layout key '{key}' is unknown: use {', '.join(LAYOUT_KEYS)}")
        if LAYOUT_KEYS[key] in out:
            raise ConfigError(f"--layout gives '{key}' twice")
        out[LAYOUT_KEYS[key]] = value
    if not out:
        raise ConfigError("--layout is empty: write e.g. tp=4,pp=4,v=5,dp_shard=4,mb=1,ac=op")
    return out


def given_layout(recipe: str | None, spec: str | None, model: str | None, gpus: int | None,
                 seq_len: int | None, global_batch: int | None) -> Given:
    """The workload and layout of ``recipe`` (a shipped name or a .toml path) changed by the
    layout string ``spec``, or of ``spec`` for ``model``; the GPUs are ``gpus`` or the product
    of the degrees. Raises ConfigError (one line: the problem and the fix) for a layout the
    trainer refuses."""
    base: dict[str, object] = {}
    if recipe is None:
        base = {"model.name": model, "compile.enabled": True, "activation_checkpoint.mode": "op"}
    if seq_len:
        base["training.seq_len"] = seq_len
    if global_batch:
        base["training.global_batch_size"] = global_batch
    changes = parse_layout_spec(spec) if spec is not None else {}
    cfg = load_config(recipe, {**base, **changes})
    _match_schedule(cfg, changes)
    world = gpus or _world_of(cfg, recipe)
    dims = validate(cfg, world, device=None)
    global_batch, _ = batch_arithmetic(cfg.training, dims.dp)
    work = Workload(model_args_of(cfg.model), cfg.training.seq_len, global_batch)
    label = " ".join(part for part in (f"recipe {recipe}" if recipe else "",
                                       f"--layout {spec}" if spec else "") if part)
    return Given(label, work, layout_of(cfg, dims), world)


def _match_schedule(cfg: Config, changes: dict[str, str]) -> None:
    """A layout string that sets the stages per rank (or pp = 1) without a schedule gets one
    that runs them: Interleaved1F1B for v > 1, 1F1B for one stage per rank."""
    p = cfg.parallel
    if "parallel.pp_schedule" in changes:
        return
    if p.pp == 1 and "parallel.pp" in changes:
        p.pp_virtual_stages, p.pp_schedule = 1, "1F1B"
    elif "parallel.pp_virtual_stages" in changes:
        if p.pp_virtual_stages > 1 and p.pp_schedule in SINGLE_STAGE:
            p.pp_schedule = "Interleaved1F1B"
        elif p.pp_virtual_stages == 1 and p.pp_schedule not in SINGLE_STAGE:
            p.pp_schedule = "1F1B"


def _world_of(cfg: Config, recipe: str | None) -> int:
    p = cfg.parallel
    if p.dp_shard == -1:
        what = f"recipe {recipe} has" if recipe else "the layout has"
        raise ConfigError(f"{what} dp_shard = -1 (FSDP over the GPUs the other degrees leave): "
                          "give --gpus N, the GPUs of the whole job")
    return p.dp_replicate * p.dp_shard * p.cp * p.tp * p.pp

