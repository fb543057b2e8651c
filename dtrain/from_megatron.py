"""A Megatron-LM command line in, a dtrain recipe out.

    python -m dtrain.from_megatron train_llama3_70b.sh > llama3_70b.toml
    python -m dtrain.from_megatron -- --num-layers 32 --hidden-size 4096 ... > recipe.toml

Reads a ``pretrain_gpt.py`` launch script (``dtrain.megatron_script``: its variables, arrays and
the launcher's world size) or the command's arguments, maps every flag of the model's shape,
the parallel sizes, the batch, the schedule, the precision, the data (path or blend, split,
tokenizer files) and the checkpoints onto the recipe's keys, and prints the recipe. A flag with
no equivalent is listed at the top of the recipe with the reason, and on standard error; one
that dtrain already does its own way (fused kernels, overlap switches) is listed as such. The
world size goes into the launch line the recipe's header shows; ``--dry-run`` checks the result
at that size.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dtrain.config.sections import toml_value
from dtrain.megatron_script import Command, read_script


@dataclass
class Translation:
    """The recipe's keys (section.key -> value), the flags not mapped with why, and the flags
    that need nothing in dtrain."""
    keys: dict[str, object] = field(default_factory=dict)
    unmapped: list[str] = field(default_factory=list)
    implied: list[str] = field(default_factory=list)
    world_size: int = 0


# Flags whose value is one key: flag -> (key, type).
DIRECT: dict[str, tuple[str, Callable]] = {
    "--num-layers": ("model.n_layers", int), "--hidden-size": ("model.hidden_size", int),
    "--ffn-hidden-size": ("model.ffn_hidden_size", int),
    "--num-attention-heads": ("model.n_heads", int), "--kv-channels": ("model.head_dim", int),
    "--num-query-groups": ("model.n_kv_heads", int),
    "--max-position-embeddings": ("model.max_seq_len", int),
    "--norm-epsilon": ("model.norm_eps", float), "--rotary-base": ("model.rope_theta", float),
    "--rope-scaling-factor": ("model.rope_scaling_factor", float),
    "--num-experts": ("model.n_experts", int), "--moe-router-topk": ("model.moe_top_k", int),
    "--moe-ffn-hidden-size": ("model.moe_hidden_size", int),
    "--moe-shared-expert-intermediate-size": ("model.moe_shared_hidden", int),
    "--moe-aux-loss-coeff": ("model.moe_aux_loss_coeff", float),
    "--moe-z-loss-coeff": ("model.moe_z_loss_coeff", float),
    "--moe-expert-capacity-factor": ("model.moe_capacity_factor", float),
    "--moe-router-bias-update-rate": ("model.moe_bias_update_rate", float),
    "--moe-router-num-groups": ("model.moe_n_group", int),
    "--moe-router-group-topk": ("model.moe_topk_group", int),
    "--moe-router-topk-scaling-factor": ("model.moe_routed_scale", float),
    "--q-lora-rank": ("model.q_lora_rank", int), "--kv-lora-rank": ("model.kv_lora_rank", int),
    "--qk-head-dim": ("model.qk_nope_head_dim", int),
    "--qk-pos-emb-head-dim": ("model.qk_rope_head_dim", int),
    "--v-head-dim": ("model.v_head_dim", int),
    "--mtp-num-layers": ("model.mtp_depths", int),
    "--mtp-loss-scaling-factor": ("model.mtp_loss_weight", float),
    "--tensor-model-parallel-size": ("parallel.tp", int),
    "--pipeline-model-parallel-size": ("parallel.pp", int),
    "--context-parallel-size": ("parallel.cp", int),
    "--expert-model-parallel-size": ("parallel.ep", int),
    "--virtual-pipeline-model-parallel-size": ("parallel.pp_virtual_stages", int),
    "--seq-length": ("training.seq_len", int),
    "--micro-batch-size": ("training.micro_batch_size", int),
    "--global-batch-size": ("training.global_batch_size", int),
    "--train-iters": ("training.steps", int), "--clip-grad": ("training.max_norm", float),
    "--seed": ("training.seed", int), "--lr": ("optimizer.lr", float),
    "--weight-decay": ("optimizer.weight_decay", float), "--adam-eps": ("optimizer.eps", float),
    "--min-lr": ("lr_schedule.min_lr", float),
    "--lr-warmup-iters": ("lr_schedule.warmup_steps", int),
    "--lr-decay-iters": ("lr_schedule.decay_steps", int),
    "--make-vocab-size-divisible-by": ("data.vocab_size_divisible_by", int),
    "--split": ("data.split", str), "--vocab-file": ("data.tokenizer", str),
    "--merge-file": ("data.merge_file", str), "--save-interval": ("checkpoint.interval", int),
    "--eval-interval": ("validation.interval", int), "--eval-iters": ("validation.steps", int),
    "--log-interval": ("metrics.log_every", int),
}
# Switches that set keys: flag -> {key: value}.
SWITCHES: dict[str, dict[str, object]] = {
    "--untie-embeddings-and-output-weights": {"model.tie_embeddings": False},
    "--add-qkv-bias": {"model.qkv_bias": True}, "--qk-layernorm": {"model.qk_norm": True},
    "--multi-latent-attention": {"model.attention": "mla"},
    "--use-rope-scaling": {"model.rope_scaling": "llama3"},
    "--bf16": {"training.mixed_precision": "bf16"},
    "--moe-grouped-gemm": {"model.moe_gemm": "grouped"},
    "--moe-router-enable-expert-bias": {"model.moe_router": "sigmoid"},
}
# What dtrain does anyway, or has no switch for: flag -> why nothing is needed.
IMPLIED = {
    "--use-mcore-models": "dtrain's model", "--swiglu": "dtrain's feed-forward is SwiGLU",
    "--disable-bias-linear": "no linear biases unless model.qkv_bias/out_bias",
    "--group-query-attention": "model.n_kv_heads", "--no-position-embedding": "RoPE only",
    "--sequence-parallel": "on with tensor parallel",
    "--use-distributed-optimizer": "FSDP shards the optimizer state (parallel.dp_shard)",
    "--overlap-grad-reduce": "FSDP overlaps it", "--overlap-param-gather": "FSDP overlaps it",
    "--use-flash-attn": "SDPA picks cuDNN or flash (model.attention_backend)",
    "--no-masked-softmax-fusion": "SDPA", "--no-gradient-accumulation-fusion":
        "model.cast_weights_once_per_step = false turns dtrain's off",
    "--no-async-tensor-model-parallel-allreduce": "", "--no-rope-fusion": "",
    "--attention-softmax-in-fp32": "SDPA", "--no-load-optim": "", "--no-load-rng": "",
    "--no-save-optim": "", "--no-save-rng": "", "--log-throughput": "logged every step",
    "--distributed-backend": "NCCL on GPUs", "--distributed-timeout-minutes":
        "training.hang_timeout_s", "--transformer-impl": "", "--init-method-std":
        "dtrain's init (N(0, 0.02), depth-scaled)", "--num-workers": "",
    "--data-cache-path": "data.index_cache", "--moe-token-dispatcher-type":
        "all-to-all under parallel.ep", "--tensorboard-dir": "<run folder>/tb",
    "--dataloader-type": "", "--rerun-mode": "", "--exit-on-missing-checkpoint": "",
    "--use-checkpoint-args": "", "--recompute-method": "activation_checkpoint.mode",
    "--recompute-num-layers": "activation_checkpoint.mode", "--fp8-margin": "",
    "--fp8-interval": "", "--fp8-amax-history-len": "TE's delayed scaling's own",
    "--fp8-amax-compute-algo": "TE's delayed scaling's own",
}
# Megatron-LM's defaults where dtrain's (or the base preset's) differ.
MEGATRON_DEFAULTS: dict[str, object] = {
    "model.tie_embeddings": True, "model.rope_theta": 10000.0, "model.norm_eps": 1e-5,
    "model.rope_scaling": "none", "model.qkv_bias": False, "model.out_bias": False,
    "model.qk_norm": False, "model.n_experts": 0, "model.moe_aux_loss_coeff": 0.0,
    "model.moe_z_loss_coeff": 0.0, "lr_schedule.decay": "linear",
}
# Flags whose one value dtrain has: flag -> (that value, why another is not mapped).
REQUIRED_VALUES = {
    "--normalization": ("RMSNorm", "dtrain's blocks use RMSNorm"),
    "--position-embedding-type": ("rope", "dtrain's attention uses RoPE"),
}
ZERO_OR_UNSUPPORTED = {"--attention-dropout": "dropout", "--hidden-dropout": "dropout"}


def _schedule(flag: str, value: str, out: Translation) -> bool:
    """The flags whose value needs a word of translation; False if ``flag`` is not one."""
    keys = out.keys
    if flag == "--lr-decay-style":
        style = value.lower()
        if style in ("cosine", "linear", "constant", "wsd"):
            keys["lr_schedule.decay"] = style
        else:
            out.unmapped.append(f"{flag} {value}: dtrain decays cosine, linear, constant or wsd")
    elif flag in REQUIRED_VALUES:
        expected, why = REQUIRED_VALUES[flag]
        (out.implied if value == expected else out.unmapped).append(
            f"{flag} {value}" + ("" if value == expected else f": {why}"))
    elif flag == "--moe-router-score-function":
        keys["model.moe_router"] = value
    elif flag == "--moe-router-load-balancing-type":
        if value == "none":
            keys["model.moe_aux_loss_coeff"] = 0.0
        elif value in ("aux_loss", "seq_aux_loss"):
            keys["model.moe_aux_loss_type"] = value
        else:
            out.unmapped.append(f"{flag} {value}: dtrain's load-balancing losses are aux_loss "
                                "and seq_aux_loss (model.moe_aux_loss_type), or none")
    elif flag == "--moe-layer-freq":
        _moe_layer_freq(value, out)
    elif flag == "--adam-beta1" or flag == "--adam-beta2":
        betas = keys.setdefault("optimizer.betas", [0.9, 0.95])
        betas[0 if flag.endswith("1") else 1] = float(value)
    elif flag == "--optimizer" and value != "adam":
        out.unmapped.append(f"{flag} {value}: dtrain trains with AdamW")
    elif flag == "--cp-comm-type":
        keys["parallel.cp_comm_type"] = {"a2a": "a2a", "allgather": "all_gather",
                                         "all_gather": "all_gather"}.get(value, "p2p")
    elif flag == "--recompute-granularity":
        keys["activation_checkpoint.mode"] = "op" if value == "selective" else "full"
    elif flag == "--num-layers-per-virtual-pipeline-stage":
        keys["parallel.pp_virtual_stages"] = -int(value)  # layers per stage: resolved at the end
    elif flag == "--fp8-format":
        keys["fp8.enabled"] = True
    elif flag == "--fp8-recipe":
        if value in ("delayed", "tensorwise", "blockwise"):
            keys["fp8.backend"], keys["fp8.recipe"] = ("te", "delayed") if value == "delayed" \
                else ("torchao", value)
        else:
            out.unmapped.append(f"{flag} {value}: dtrain's FP8 recipes are tensorwise, rowwise, "
                                "blockwise (torchao) and delayed, current (Transformer Engine)")
    elif flag == "--fp16":
        out.unmapped.append(f"{flag}: dtrain computes in bf16 (training.mixed_precision)")
    elif flag == "--save":
        keys["checkpoint.enabled"], keys["checkpoint.folder"] = True, value
    elif flag == "--load":
        if value != keys.get("checkpoint.folder"):
            out.unmapped.append(f"{flag} {value}: a run resumes from its checkpoint.folder "
                                "(the --save folder); for weights only, convert them and set "
                                "checkpoint.initial_weights")
    else:
        return False
    return True


def _moe_layer_freq(value: str, out: Translation) -> None:
    """``--moe-layer-freq N`` or Megatron's pattern ``([0]*k+[1]*n)`` (k dense, then MoE)."""
    text = value.replace(" ", "")
    if text.isdigit():
        out.keys["model.moe_layer_freq"] = int(text)
        return
    parts = dict((int(bit), int(count)) for bit, count in
                 (p.strip("()[]").split("]*") for p in text.strip("()").split("+")
                  if "]*" in p)) if "]*" in text else {}
    if set(parts) == {0, 1} and text.strip("()").startswith("[0]"):
        out.keys["model.moe_first_dense_layers"] = parts[0]
    else:
        out.unmapped.append(f"--moe-layer-freq {value}: dtrain takes every Nth block or the "
                            "first k dense ([0]*k+[1]*n)")


def _data(flag: str, value: list[str], out: Translation) -> bool:
    keys = out.keys
    if flag == "--data-path":
        keys["data.source"], keys["data.path"] = "indexed", " ".join(value)
    elif flag == "--tokenizer-model":
        keys["data.tokenizer"] = value[0]
    elif flag == "--tokenizer-type":
        if value[0] not in ("GPT2BPETokenizer", "HuggingFaceTokenizer"):
            out.unmapped.append(f"{flag} {value[0]}: dtrain reads HF tokenizer.json files or a "
                                "GPT-2 vocab.json + merges.txt (data.tokenizer)")
    elif flag == "--mock-data":
        out.unmapped.append("--mock-data: dtrain trains on real data: set data.path")
    elif flag == "--train-samples":
        keys["training.steps"] = -int(value[0])  # samples: divided by the batch at the end
    elif flag == "--lr-warmup-fraction":
        keys["lr_schedule.warmup_steps"] = -float(value[0])  # a fraction: resolved at the end
    else:
        return False
    return True


def _values(args: list[str], i: int) -> list[str]:
    """The words after ``args[i]`` up to the next flag."""
    j = i + 1
    while j < len(args) and not args[j].startswith("--"):
        j += 1
    return args[i + 1:j]


def translate(command: Command) -> Translation:
    """The recipe keys of ``command``'s flags (see the module docstring)."""
    out, args = Translation(world_size=command.world_size), command.args
    for i, word in enumerate(args):
        if not word.startswith("--"):
            continue
        flag, _, inline = word.partition("=")
        values = [inline] if inline else _values(args, i)
        value = values[0] if values else ""
        if flag in DIRECT:
            key, kind = DIRECT[flag]
            out.keys[key] = kind(value)
        elif flag in SWITCHES:
            out.keys.update(SWITCHES[flag])
        elif flag in IMPLIED:
            out.implied.append(flag + (f" ({IMPLIED[flag]})" if IMPLIED[flag] else ""))
        elif flag in ZERO_OR_UNSUPPORTED:
            if float(value) != 0:
                out.unmapped.append(f"{flag} {value}: dtrain trains without dropout")
        elif not (_schedule(flag, value, out) or _data(flag, values, out)):
            out.unmapped.append(f"{flag}{' ' + ' '.join(values) if values else ''}: no dtrain "
                                "equivalent")
    _finish(out, args)
    return out


def _finish(out: Translation, args: list[str]) -> None:
    """What depends on several flags: Megatron's defaults where dtrain's differ, samples to
    steps, the warm-up fraction, the validation."""
    keys = out.keys
    if "--group-query-attention" not in args and "model.n_heads" in keys:
        keys["model.n_kv_heads"] = keys["model.n_heads"]  # --num-query-groups needs it
    if "model.ffn_hidden_size" not in keys and "model.hidden_size" in keys:
        keys["model.ffn_hidden_size"] = int(4 * keys["model.hidden_size"] * 2 / 3 / 64) * 64
    for key, value in MEGATRON_DEFAULTS.items():
        keys.setdefault(key, value)
    if keys.get("model.attention") == "mla":
        keys.setdefault("model.q_lora_rank", 0)  # Megatron's default: no query latent
    if "--bf16" not in args:
        keys.setdefault("training.mixed_precision", "fp32")
    if (per_stage := keys.get("parallel.pp_virtual_stages", 1)) < 0:
        stages = keys.get("parallel.pp", 1) * -per_stage
        keys["parallel.pp_virtual_stages"] = keys.get("model.n_layers", stages) // stages
    if keys.get("parallel.pp_virtual_stages", 1) > 1:
        keys["parallel.pp_schedule"] = "Interleaved1F1B"  # Megatron's interleaved schedule
    elif keys.get("parallel.pp", 1) > 1:
        keys["parallel.pp_schedule"] = "1F1B"
    if isinstance(steps := keys.get("training.steps"), int) and steps < 0:
        keys["training.steps"] = -steps // keys.get("training.global_batch_size", 1)
    warmup = keys.get("lr_schedule.warmup_steps")
    if isinstance(warmup, float):
        total = keys.get("lr_schedule.decay_steps") or keys.get("training.steps", 0)
        keys["lr_schedule.warmup_steps"] = int(-warmup * total)
    if "validation.interval" in keys and keys.get("data.source") == "indexed":
        if keys.get("parallel.pp", 1) > 1:
            out.unmapped.append("--eval-interval: dtrain's validation does not run under a "
                                "pipeline (parallel.pp > 1): left off")
        else:
            keys["validation.enabled"] = True


def recipe(out: Translation, source: str) -> str:
    """The recipe TOML: a header with the source, the launch line and the flags not mapped, then
    one table per section."""
    lines = [f"# dtrain recipe translated from Megatron-LM's {source}"]
    if out.world_size:
        nodes = max(1, out.world_size // 8)
        lines.append(f"# launch: torchrun --nnodes {nodes} --nproc_per_node "
                     f"{out.world_size // nodes} -m dtrain.train --recipe THIS_FILE")
    lines += [f"# not mapped: {line}" for line in out.unmapped]
    lines += [f"# nothing needed: {line}" for line in out.implied]
    keys = {"model.name": "llama3_debug", **out.keys}  # every shape key set: no preset's value
    sections: dict[str, list[str]] = {}
    for key, value in keys.items():
        section, name = key.split(".", 1)
        sections.setdefault(section, []).append(f"{name} = {toml_value(value)}")
    for section, entries in sections.items():
        lines += ["", f"[{section}]", *entries]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtrain.from_megatron",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("script", nargs="?", help="a Megatron-LM launch script")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="a variable the script reads, as given before 'bash script.sh'")
    parser.add_argument("--world-size", type=int, default=0,
                        help="the world size, where the script does not say it")
    argv = sys.argv[1:] if argv is None else argv
    given = argv[argv.index("--") + 1:] if "--" in argv else None
    known = parser.parse_args(argv[:argv.index("--")] if given is not None else argv)
    try:
        if given is not None:
            command, source = Command(given), "command line"
        elif known.script:
            env = dict(item.split("=", 1) for item in known.env)
            command = read_script(Path(known.script).read_text(), env)
            source = Path(known.script).name
        else:
            parser.error("give a launch script, or the command's arguments after --")
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = translate(command)
    out.world_size = known.world_size or out.world_size
    out.unmapped += [f"{flag}: inside a conditional block of the script, not followed"
                     for flag in dict.fromkeys(command.skipped)]
    for line in out.unmapped:
        print(f"not mapped: {line}", file=sys.stderr)
    sys.stdout.write(recipe(out, source))
    return 0


if __name__ == "__main__":
    sys.exit(main())
