"""Typed run configuration: one dataclass per TOML section, dotted CLI overrides, validation.

A recipe is a TOML file whose tables are the sections below. ``load_config`` reads it, applies
overrides such as ``--training.steps 100`` or ``--parallel.tp=2``, checks every value and returns a
``Config``. Each component receives only its own section (``cfg.model``, ``cfg.optimizer``, ...).
Every field carries a docstring: ``python -m dtrain.train --help`` prints them.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import tomllib
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A user's configuration mistake. The message names the key, the value and the fix."""


@dataclass
class JobConfig:
    name: str = "debug"
    """Run name; the run folder is ``<output_dir>/<name>``."""
    output_dir: str = "outputs"
    """Folder that holds one sub-folder per run (config.toml, tb/, metrics.jsonl)."""
    description: str = ""
    """Free text saved with the run."""


@dataclass
class ModelConfig:
    name: str = "llama3_debug"
    """Model preset from ``dtrain.models.presets`` (llama3_debug, llama3_8b, ...)."""
    n_layers: int = 0
    """Override the preset's number of transformer blocks (0 keeps the preset's)."""
    vocab_size: int = 0
    """Override the preset's vocabulary size (0 keeps the preset's)."""
    attention_backend: Literal["auto", "cudnn", "flash", "efficient", "math"] = "auto"
    """SDPA kernel; auto prefers cuDNN, then flash, then memory-efficient, then math."""
    moe_aux_loss_coeff: float = -1.0
    """MoE presets: weight of the load-balancing loss, summed over layers (-1 keeps the
    preset's; the logged loss stays the plain LM loss)."""
    moe_z_loss_coeff: float = -1.0
    """MoE presets: weight of the router z-loss, summed over layers (-1 keeps the preset's)."""
    moe_capacity_factor: float = 0.0
    """MoE presets: 0 is dropless; else each expert takes at most capacity_factor x tokens x
    top_k / experts assignments per forward and drops the rest."""
    moe_router: Literal["preset", "softmax", "sigmoid"] = "preset"
    """MoE presets: router scores; softmax top-k (Mixtral) or sigmoid with an expert bias
    updated after each step for balance (DeepSeek-V3, aux-loss-free)."""
    moe_bias_update_rate: float = 0.001
    """MoE with sigmoid router: step of the expert-bias update per optimizer step."""
    moe_gemm: Literal["auto", "grouped", "loop"] = "auto"
    """MoE expert compute: grouped GEMM (torch._grouped_mm), a loop over experts, or auto
    (grouped for bf16 on CUDA sm90+, else the loop)."""


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    """Data-parallel replicas (HSDP's replicate dimension)."""
    dp_shard: int = -1
    """FSDP sharding degree; -1 takes the ranks the other degrees leave."""
    cp: int = 1
    """Context-parallel degree (sequence split across ranks inside attention)."""
    cp_comm_type: Literal["p2p", "all_gather", "a2a"] = "p2p"
    """With cp > 1, attention across the sequence shards: p2p (ring exchange of K/V overlapped
    with compute), all_gather (gather K/V), a2a (Ulysses: all-to-all to a head split; the heads
    per tensor-parallel rank must divide by cp)."""
    tp: int = 1
    """Tensor-parallel degree (with sequence parallel)."""
    pp: int = 1
    """Pipeline-parallel degree."""
    ep: int = 1
    """Expert-parallel degree, borrowed from dp_shard x cp."""
    fsdp_reshard_after_forward: Literal["auto", "default", "always", "never"] = "auto"
    """Free gathered weights after forward: always, never (more memory, less communication),
    default (every block but the last, whose weights backward needs first), or auto: default,
    then from the third step on CUDA the last blocks keep their gathered weights from forward to
    backward (no all-gather for their backward) as far as ``fsdp_auto_memory_fraction`` of the
    device's memory allows, measured on the second step."""
    fsdp_auto_memory_fraction: float = 0.75
    """With fsdp_reshard_after_forward = "auto": the share of the device's memory the allocated
    peak may reach with the blocks kept gathered (the allocator reserves more than it
    allocates: past about 0.8 it starts to release and retry, which stalls steps)."""
    fsdp_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype of the gradient reduce-scatter under bf16 mixed precision."""
    fsdp_cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory."""
    loss_parallel: bool = True
    """With tp > 1: compute the cross-entropy on vocabulary-sharded logits (never gathered)."""
    async_tp: bool = False
    """With tp > 1 on CUDA under compile: overlap TP communication with the matmuls."""
    pp_schedule: Literal["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS",
                         "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"] = "1F1B"
    """Pipeline schedule (pp > 1); the interleaved ones need pp_virtual_stages > 1, the V ones 2."""
    pp_virtual_stages: int = 1
    """Pipeline stages per rank."""
    pp_layout: str = ""
    """Layers per stage, e.g. "E|t*4|t*4|L" (E embedding, t*N layers, L output; | between
    stages); "" splits the layers evenly."""


@dataclass
class TrainingConfig:
    steps: int = 100
    """Optimizer steps to run."""
    seq_len: int = 256
    """Tokens per sequence."""
    global_batch_size: int = 0
    """Sequences per optimizer step over all data-parallel ranks; 0 means
    micro_batch_size x data-parallel degree x grad_accum_steps."""
    micro_batch_size: int = 1
    """Sequences per forward/backward on one rank."""
    grad_accum_steps: int = 0
    """Micro-batches per optimizer step; 0 derives it from global_batch_size (or 1 if unset)."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    seed: int = 42
    """Seed for weight init and data order; the same seed gives the same run on any layout."""
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto"
    """Compute dtype; auto is bf16 on GPU and fp32 on CPU. Master weights stay fp32."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where to train; auto takes CUDA when present."""
    deterministic: bool = False
    """Ask torch for deterministic kernels (slower)."""
    gc_interval: int = 50
    """Python's automatic garbage collection is off while training (its pauses would land at
    random inside steps, stalling the device's queue) and a young-generation collection runs
    every this many steps; 0 leaves Python's collector alone."""


@dataclass
class OptimizerConfig:
    name: Literal["adamw"] = "adamw"
    """Optimizer."""
    lr: float = 3e-4
    """Peak learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam beta1, beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices (not on norms)."""
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"
    """AdamW kernel; auto is fused on CUDA and foreach on CPU."""
    overlap_step: bool = True
    """On CUDA under FSDP (without pipeline parallel or CPU offload): run the step one FSDP unit
    at a time on a side stream, each unit's next all-gather waiting only for its own update, so
    that the updates overlap the next forward. The same updates; off runs the step whole."""


@dataclass
class LRScheduleConfig:
    warmup_steps: int = 0
    """Linear warmup from lr/warmup_steps to lr."""
    decay: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    """Shape after warmup; wsd holds lr then decays over the last wsd_decay_fraction of steps."""
    min_lr: float = 0.0
    """Learning rate at the last step (cosine, linear, wsd)."""
    wsd_decay_fraction: float = 0.2
    """Fraction of all steps spent decaying in the wsd schedule."""
    wsd_decay_shape: Literal["linear", "cosine", "sqrt"] = "linear"
    """Decay curve of the wsd schedule's last phase."""


@dataclass
class DataConfig:
    source: Literal["text", "hf", "indexed"] = "text"
    """text: one JSON-lines or text file, tokenized up front (small data); hf: HF datasets,
    streamed and tokenized on the fly (local JSON/JSONL/Parquet/text or a dataset name);
    indexed: Megatron-LM .bin/.idx prefixes, optionally a weighted blend."""
    path: str = "builtin:debug/corpus.jsonl"
    """text/hf: a file, folder or dataset name (``builtin:`` names a file shipped with dtrain);
    indexed: a prefix, or a Megatron-style blend "0.3 /data/a_text_document 0.7 /data/b"."""
    text_field: str = "text"
    """Field that holds the document text (text and hf sources)."""
    tokenizer: str = "builtin:debug/tokenizer.json"
    """HF tokenizer.json (or a folder holding one); BOS/EOS come from tokenizer_config.json."""
    bos_token: str = ""
    """BOS token text, overriding tokenizer_config.json ("" keeps it)."""
    eos_token: str = ""
    """EOS token text, overriding tokenizer_config.json ("" keeps it)."""
    vocab_size_divisible_by: int = 128
    """Pad the model's vocabulary to a multiple of this times the tensor-parallel degree."""
    hf_config: str = ""
    """hf source: the dataset's configuration name, if it has several."""
    hf_split: str = "train"
    """hf source: the dataset split to read."""
    split: str = "969,30,1"
    """indexed source: train/valid/test document split weights, as Megatron's --split."""
    index_cache: str = ""
    """indexed source: folder for the cached sample indices ("" = beside the data)."""


@dataclass
class ValidationConfig:
    enabled: bool = False
    """Evaluate the loss on held-out data every ``interval`` steps and at the last step."""
    interval: int = 100
    """Steps between evaluations."""
    steps: int = 10
    """Micro-batches per rank in each evaluation (the same ones every time)."""
    path: str = ""
    """Held-out data in the training source's format; "" takes the indexed source's valid
    split of data.path (text and hf sources need a path)."""


@dataclass
class CheckpointConfig:
    enabled: bool = False
    """Save distributed checkpoints and resume from the latest one at start-up."""
    folder: str = "checkpoints"
    """Folder inside the run folder (or an absolute path)."""
    interval: int = 500
    """Save every this many steps (and at the last step)."""
    keep_last: int = 3
    """Checkpoints to keep; older ones are deleted (0 keeps all)."""
    async_save: bool = False
    """Write checkpoints in the background while training continues."""
    load_step: int = 0
    """Resume from this step's checkpoint instead of the latest (0 = latest)."""
    initial_weights: str = ""
    """Start a new run from these model weights: a checkpoint made by tools/convert_hf.py
    import, or any dtrain checkpoint step folder (ignored when resuming a run)."""


@dataclass
class MetricsConfig:
    log_every: int = 10
    """Console line and TensorBoard scalars every this many steps."""
    tensorboard: bool = True
    """Write TensorBoard event files into <run>/tb."""
    peak_tflops: float = 0.0
    """Peak bf16 TFLOP/s per device for MFU; 0 looks it up by device name."""


@dataclass
class ActivationCheckpointConfig:
    mode: Literal["none", "full", "layer", "op"] = "none"
    """none; full (recompute every block); layer (checkpoint every Nth block); op (selective by
    operator: keep attention and matmul outputs, recompute the cheap rest)."""
    every_n_layers: int = 2
    """For mode = "layer": checkpoint every this many blocks."""
    op_recompute_every_second_mm: bool = True
    """For mode = "op": recompute every second matmul too (less memory for a little compute)."""


@dataclass
class CompileConfig:
    enabled: bool = False
    """torch.compile each transformer block and the loss."""


@dataclass
class FP8Config:
    enabled: bool = False
    """Train the linear layers in FP8 (GPUs of compute capability 8.9 or newer: Ada, Hopper,
    Blackwell)."""
    backend: Literal["torchao", "te"] = "torchao"
    """torchao float8 (pip install dtrain[fp8]) or Transformer Engine (pip install dtrain[te])."""
    recipe: Literal["tensorwise", "rowwise", "delayed", "current"] = "tensorwise"
    """Scaling. torchao: tensorwise (fastest; FP8 all-gather under FSDP) or rowwise (one scale
    per row, more accurate); te: delayed (scales from an amax history) or current."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear layers kept in bf16: module names, dotted suffixes or globs (output,
    feed_forward.w2, layers.0.*). Layers whose dimensions are not multiples of 16 stay too."""
    fsdp_float8_all_gather: bool = True
    """torchao tensorwise under FSDP: all-gather weights in FP8, with their scales computed in
    one all-reduce after each optimizer step."""
    fused_weight_cast: bool = True
    """With FP8 all-gather: cast each weight shard to FP8 in one compiled kernel (the same bytes
    as torchao's three eager kernels; replaces torchao's method for the whole process)."""
    emulate: bool = False
    """torchao only: compute the FP8 matmuls in high precision, so the FP8 path (casts, scales,
    FP8 all-gather) runs on any device, the CPU included; for testing, not for speed."""


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(
        default_factory=ActivationCheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    fp8: FP8Config = field(default_factory=FP8Config)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
            lines.append("")
        return "\n".join(lines)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}

# Ranges checked after loading: (section, key) -> (predicate, what is allowed).
_RANGES: dict[tuple[str, str], tuple[typing.Callable[[Any], bool], str]] = {
    ("model", "n_layers"): (lambda v: v >= 0, "an integer >= 0"),
    ("model", "vocab_size"): (lambda v: v >= 0, "an integer >= 0"),
    ("model", "moe_aux_loss_coeff"): (lambda v: v >= 0 or v == -1, "-1 or a number >= 0"),
    ("model", "moe_z_loss_coeff"): (lambda v: v >= 0 or v == -1, "-1 or a number >= 0"),
    ("model", "moe_capacity_factor"): (lambda v: v >= 0, "a number >= 0 (0 = dropless)"),
    ("model", "moe_bias_update_rate"): (lambda v: v >= 0, "a number >= 0"),
    ("parallel", "dp_replicate"): (lambda v: v >= 1, "an integer >= 1"),
    ("parallel", "dp_shard"): (lambda v: v == -1 or v >= 1, "-1 or an integer >= 1"),
    ("parallel", "cp"): (lambda v: v >= 1, "an integer >= 1"),
    ("parallel", "tp"): (lambda v: v >= 1, "an integer >= 1"),
    ("parallel", "pp"): (lambda v: v >= 1, "an integer >= 1"),
    ("parallel", "ep"): (lambda v: v >= 1, "an integer >= 1"),
    ("parallel", "pp_virtual_stages"): (lambda v: v >= 1, "an integer >= 1"),
    ("parallel", "fsdp_auto_memory_fraction"): (lambda v: 0 < v <= 1, "a number in (0, 1]"),
    ("training", "steps"): (lambda v: v >= 1, "an integer >= 1"),
    ("training", "seq_len"): (lambda v: v >= 2, "an integer >= 2"),
    ("training", "global_batch_size"): (lambda v: v >= 0, "an integer >= 0"),
    ("training", "micro_batch_size"): (lambda v: v >= 1, "an integer >= 1"),
    ("training", "grad_accum_steps"): (lambda v: v >= 0, "an integer >= 0"),
    ("training", "gc_interval"): (lambda v: v >= 0, "an integer >= 0 (0: automatic collection)"),
    ("training", "max_norm"): (lambda v: v >= 0, "a number >= 0"),
    ("optimizer", "lr"): (lambda v: v > 0, "a number > 0"),
    ("optimizer", "betas"): (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v),
                             "two numbers in [0, 1)"),
    ("optimizer", "eps"): (lambda v: v > 0, "a number > 0"),
    ("optimizer", "weight_decay"): (lambda v: v >= 0, "a number >= 0"),
    ("lr_schedule", "warmup_steps"): (lambda v: v >= 0, "an integer >= 0"),
    ("lr_schedule", "min_lr"): (lambda v: v >= 0, "a number >= 0"),
    ("lr_schedule", "wsd_decay_fraction"): (lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    ("checkpoint", "interval"): (lambda v: v >= 1, "an integer >= 1"),
    ("validation", "interval"): (lambda v: v >= 1, "an integer >= 1"),
    ("validation", "steps"): (lambda v: v >= 1, "an integer >= 1"),
    ("checkpoint", "keep_last"): (lambda v: v >= 0, "an integer >= 0"),
    ("checkpoint", "load_step"): (lambda v: v >= 0, "an integer >= 0"),
    ("metrics", "log_every"): (lambda v: v >= 1, "an integer >= 1"),
    ("data", "vocab_size_divisible_by"): (lambda v: v >= 1, "an integer >= 1"),
    ("metrics", "peak_tflops"): (lambda v: v >= 0, "a number >= 0"),
    ("activation_checkpoint", "every_n_layers"): (lambda v: v >= 1, "an integer >= 1"),
}


def load_config(recipe: str | Path | None = None,
                overrides: typing.Sequence[str] | dict[str, Any] = ()) -> Config:
    """Reads a recipe (a name from ``recipes/`` or a path; None for the defaults), applies
    overrides (``["training.steps=10"]``, ``["--training.steps", "10"]`` or
    ``{"training.steps": 10}``) and returns the validated ``Config``. Raises ``ConfigError``."""
    raw: dict[str, Any] = {}
    if recipe is not None:
        path = find_recipe(recipe)
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"recipe {path} is not valid TOML: {e}") from None
    cfg = Config()
    for section, values in raw.items():
        if not isinstance(values, dict):
            raise ConfigError(f"recipe key '{section}' must be a [section] table; "
                              f"valid sections: {', '.join(SECTIONS)}")
        for key, value in values.items():
            _set(cfg, section, key, value, from_cli=False)
    items = overrides.items() if isinstance(overrides, dict) else _pair_overrides(overrides)
    for dotted, value in items:
        section, _, key = dotted.partition(".")
        _set(cfg, section, key, value, from_cli=isinstance(value, str))
    for (section, key), (ok, allowed) in _RANGES.items():
        value = getattr(getattr(cfg, section), key)
        if not ok(value):
            raise ConfigError(f"{section}.{key} = {value!r} is out of range: use {allowed}")
    _check_fp8(cfg.fp8)
    return cfg


FP8_RECIPES = {"torchao": ("tensorwise", "rowwise"), "te": ("delayed", "current")}


def _check_fp8(cfg: FP8Config) -> None:
    """The recipe must be one of the backend's."""
    recipes = FP8_RECIPES[cfg.backend]
    if cfg.recipe not in recipes:
        raise ConfigError(f"fp8.recipe = '{cfg.recipe}' is not a recipe of fp8.backend = "
                          f"'{cfg.backend}': use one of {', '.join(recipes)}")


def find_recipe(recipe: str | Path) -> Path:
    """A path as given, else ``recipes/NAME[.toml]`` from the checkout or the installed package."""
    path = Path(recipe)
    if path.is_file():
        return path
    name = path.name if path.suffix == ".toml" else path.name + ".toml"
    for folder in _recipe_folders():
        if (folder / name).is_file():
            return folder / name
    known = sorted(p.stem for folder in _recipe_folders() for p in folder.glob("*.toml"))
    raise ConfigError(f"recipe '{recipe}' not found: give a path to a .toml file or one of "
                      f"{', '.join(known) or '(none installed)'}")


def _recipe_folders() -> list[Path]:
    folders = [Path(__file__).resolve().parent.parent / "recipes"]
    try:
        folders.append(Path(str(resources.files("dtrain.recipes"))))
    except ModuleNotFoundError:
        pass
    return [f for f in folders if f.is_dir()]


def _pair_overrides(args: typing.Sequence[str]) -> list[tuple[str, Any]]:
    """``--a.b=1``, ``--a.b 1``, ``a.b=1`` and a bare ``--a.b`` (boolean true)."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i].removeprefix("--")
        if "=" in arg:
            key, value = arg.split("=", 1)
            pairs.append((key, value))
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            pairs.append((arg, args[i + 1]))
            i += 1
        else:
            pairs.append((arg, "true"))
        i += 1
    return pairs


def _set(cfg: Config, section: str, key: str, value: Any, from_cli: bool) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"unknown section '{section}'{_suggest(section, SECTIONS)}; "
                          f"valid sections: {', '.join(SECTIONS)}")
    obj = getattr(cfg, section)
    fields = {f.name: f for f in dataclasses.fields(obj)}
    if key not in fields:
        raise ConfigError(f"unknown key '{section}.{key}'{_suggest(key, fields, section)}; "
                          f"valid keys in [{section}]: {', '.join(fields)}")
    hint = typing.get_type_hints(type(obj))[key]
    setattr(obj, key, _coerce(f"{section}.{key}", value, hint, from_cli))


def _suggest(name: str, choices: typing.Iterable[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{prefix + '.' if prefix else ''}{close[0]}'?)" if close else ""


def _coerce(key: str, value: Any, hint: Any, from_cli: bool) -> Any:
    """Checks (and for CLI strings, parses) ``value`` against the field's type."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(f"{key} = {value!r} is not a valid choice: use one of "
                              f"{', '.join(map(str, choices))}")
        return value
    if origin is list:
        (item,) = typing.get_args(hint) or (str,)
        if from_cli and isinstance(value, str):
            value = [v.strip() for v in value.strip("[]").split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{key} = {value!r} has the wrong type: expected a list of "
                              f"{item.__name__}")
        return [_coerce(key, v, item, from_cli) for v in value]
    if hint is bool:
        if from_cli and isinstance(value, str) and value.lower() in ("true", "1", "yes"):
            return True
        if from_cli and isinstance(value, str) and value.lower() in ("false", "0", "no"):
            return False
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} = {value!r} has the wrong type: expected true or false")
    if hint is int:
        if from_cli and isinstance(value, str):
            try:
                value = int(value)
            except ValueError:
                pass
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key} = {value!r} has the wrong type: expected an integer")
    if hint is float:
        if from_cli and isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key} = {value!r} has the wrong type: expected a number")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} = {value!r} has the wrong type: expected a string")
    raise TypeError(f"unsupported config field type {hint} for {key}")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def field_docs(section_cls: type) -> dict[str, str]:
    """The docstring written under each field of a config dataclass (for ``--help``)."""
    tree = ast.parse(inspect.getsource(section_cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def help_text() -> str:
    """Every section and field with its type, default and docstring."""
    lines = []
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]")
        docs = field_docs(cls)
        defaults = dataclasses.asdict(cls())
        hints = typing.get_type_hints(cls)
        for name, doc in docs.items():
            kind = hints[name]
            kind = ("|".join(map(str, typing.get_args(kind)))
                    if typing.get_origin(kind) is Literal else getattr(kind, "__name__", kind))
            lines.append(f"  --{section}.{name} ({kind}, default {_toml_value(defaults[name])})")
            lines.append(f"      {doc}")
    return "\n".join(lines)
