"""Any shape from the [model] section: a preset gives the defaults, each key set replaces its
field, the cross-checks name the keys, and a shape declared only in a TOML recipe trains, plans
and dry-runs."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from dtrain import Trainer, load_config
from dtrain.checks import validate
from dtrain.config import ConfigError, help_text
from dtrain.model_shape import SHAPE_KEYS, model_args_of
from dtrain.models import Transformer, model_args
from dtrain.plan.dry_run import dry_run
from dtrain.run import feature_lines
from dtrain.train import main as train_main

# A shape no preset has: 6 query heads over 2 KV heads of 40 channels (not 192 / 6), an
# explicit feed-forward width, QKV biases and QK-norm, untied, YaRN.
SHAPE = {"model.hidden_size": 192, "model.n_heads": 6, "model.n_kv_heads": 2,
         "model.head_dim": 40, "model.ffn_hidden_size": 320, "model.norm_eps": 1e-6,
         "model.rope_theta": 10000.0, "model.qkv_bias": True, "model.qk_norm": True,
         "model.max_seq_len": 512, "model.rope_scaling": "yarn", "model.rope_scaling_factor": 2.0,
         "model.rope_original_max_seq_len": 256}


def args_of(overrides: dict):
    return model_args_of(load_config("debug", overrides).model)


def test_unset_keys_keep_the_preset_and_set_ones_replace_their_field():
    assert args_of({}) == dataclasses.replace(model_args("llama3_debug"), rope_kernel=True)
    args = args_of(SHAPE)
    assert (args.dim, args.n_heads, args.kv_heads, args.head_dim) == (192, 6, 2, 40)
    assert (args.ffn_dim, args.norm_eps, args.rope_theta, args.max_seq_len) == (
        320, 1e-6, 10000.0, 512)
    assert args.qkv_bias and args.qk_norm and not args.out_bias and not args.tie_embeddings
    assert (args.rope_scaling.kind, args.rope_scaling.factor,
            args.rope_scaling.original_max_seq_len, args.rope_scaling.beta_fast) == (
        "yarn", 2.0, 256, 32.0)
    assert args.n_layers == 4 and args.vocab_size == 4096  # the preset's


def test_every_shape_key_is_a_model_key_with_help():
    text = help_text()
    for key in (*SHAPE_KEYS, "hf_config", "rope_scaling", "moe_layer_freq",
                "moe_first_dense_layers", *[k for k in vars(load_config().model)
                                            if k.startswith("rope_")]):
        assert f"--model.{key} (" in text, key


def test_the_feed_forward_rule_and_the_rope_scaling_follow_their_keys():
    assert args_of({"model.ffn_dim_multiplier": 1.5, "model.multiple_of": 32}).ffn_dim == \
        32 * -(-int(1.5 * int(8 * 256 / 3)) // 32)
    preset = args_of({"model.name": "llama3_8b"}).rope_scaling
    assert (preset.kind, preset.factor) == ("llama3", 8.0)
    assert args_of({"model.name": "llama3_8b", "model.rope_scaling": "none"}).rope_scaling is None
    stretched = args_of({"model.name": "llama3_8b", "model.rope_scaling_factor": 16.0})
    assert (stretched.rope_scaling.factor, stretched.rope_scaling.high_freq_factor) == (16.0, 4.0)


def test_moe_keys_make_a_dense_model_moe_and_choose_its_layers():
    args = args_of({"model.n_layers": 6, "model.n_experts": 4, "model.moe_top_k": 1,
                    "model.moe_hidden_size": 96, "model.moe_layer_freq": 2,
                    "model.moe_first_dense_layers": 1})
    assert (args.n_experts, args.moe_top_k, args.expert_dim) == (4, 1, 96)
    assert args.moe_layers == (2, 4)
    assert args_of({"model.name": "mixtral_debug", "model.n_experts": 0}).n_experts == 0


@pytest.mark.parametrize(("overrides", "message"), [
    ({"model.hidden_size": 100, "model.n_heads": 6},
     "model.hidden_size = 100 is not divisible by model.n_heads = 6: change one, or set "
     "model.head_dim"),
    ({"model.n_heads": 6, "model.n_kv_heads": 4, "model.head_dim": 32},
     "model.n_kv_heads = 4 does not divide model.n_heads = 6: use a divisor of n_heads (1 for "
     "MQA)"),
    ({"model.hidden_size": 264, "model.n_heads": 8},
     "the head width 33 (hidden_size / n_heads) is odd: RoPE rotates pairs of channels; set "
     "model.head_dim to an even width"),
    ({"model.n_experts": 4, "model.moe_top_k": 5},
     "model.moe_top_k = 5 exceeds model.n_experts = 4: route each token to at most n_experts"),
    ({"model.n_experts": 4, "model.moe_first_dense_layers": 4},
     "model.moe_layer_freq and model.moe_first_dense_layers leave no MoE layer"),
    ({"model.head_dim": 7}, "model.head_dim = 7 is out of range: use an even integer >= 2"),
    ({"model.n_kv_heads": 0}, "model.n_kv_heads = 0 is out of range: use an integer >= 1"),
    ({"model.n_heads": 4, "parallel.tp": 8}, "n_heads"),
    ({"model.hf_config": "/nonexistent/model"},
     "model.hf_config = '/nonexistent/model': no such file or folder with a config.json"),
], ids=["heads-divide", "kv-divide", "odd-head", "top-k", "no-moe-layer", "head-dim-range",
        "kv-range", "tp-heads", "hf-config-missing"])
def test_a_shape_that_cannot_be_built_is_one_line_naming_the_keys(capsys, overrides, message):
    # The command's own function, in this process (a process each took 7 s of CI's 2 cores);
    # the test below runs one of these through `python -m dtrain.train`.
    code = train_main(shape_error_args(overrides))
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], stderr


def test_a_shape_error_from_the_command_is_its_one_stderr_line_and_exit_code_2(cli):
    result = cli(shape_error_args({"model.hidden_size": 100, "model.n_heads": 6}))
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == ["error: model.hidden_size = 100 is not divisible by model.n_heads = 6: "
                     "change one, or set model.head_dim"], result.stderr


def shape_error_args(overrides: dict) -> list[str]:
    """The dry run's arguments for a debug model with ``overrides`` (8 ranks where TP is set)."""
    args = [a for key, value in overrides.items() for a in (f"--{key}", json.dumps(value)
                                                          if not isinstance(value, str) else value)]
    world = 8 if overrides.get("parallel.tp") else 1
    return ["--recipe", "debug", *args, "--dry-run", "--dry-run-world-size", str(world)]


def test_a_shape_declared_only_in_a_toml_recipe_trains_and_is_saved_as_set(tmp_path):
    keys = "\n".join(f"{key.split('.')[1]} = {json.dumps(value)}" for key, value in SHAPE.items())
    recipe = tmp_path / "shape.toml"
    recipe.write_text(f'[model]\nname = "llama3_debug"\nn_layers = 2\n{keys}\n'
                      "[training]\nsteps = 3\nseq_len = 64\nglobal_batch_size = 2\n"
                      "micro_batch_size = 1\n[metrics]\nlog_every = 1\ntensorboard = false\n")
    trainer = Trainer(load_config(recipe, {"job.output_dir": str(tmp_path / "out")}))
    lines = feature_lines(trainer)  # the start-up summary says where shape and weights came from
    assert lines[0] == "weights: initialised from seed 42"
    assert lines[1].startswith("shape: preset llama3_debug, with hidden_size, n_heads, "
                               "n_kv_heads, head_dim, ffn_hidden_size") and "qk_norm" in lines[1]
    records = trainer.train()
    assert [r["step"] for r in records] == [1, 2, 3]
    attention = trainer.model.layers["0"].attention
    assert attention.wq.weight.shape == (6 * 40, 192) and attention.wk.bias.shape == (2 * 40,)
    saved = (trainer.run_dir / "config.toml").read_text()
    assert re.search(r"^head_dim = 40$", saved, re.M) and re.search(r"^qk_norm = true$", saved,
                                                                     re.M)
    again = load_config(trainer.run_dir / "config.toml")
    assert model_args_of(again.model) == model_args_of(trainer.config.model)


def test_the_dry_run_and_the_memory_model_take_the_section():
    cfg = load_config("debug", {k: v for k, v in SHAPE.items()
                                if not k.startswith("model.rope")})
    with torch.device("meta"):
        params = Transformer(model_args_of(cfg.model)).num_params()
    report = dry_run(cfg, 1)
    assert report.local_params == params != Transformer(model_args("llama3_debug")).num_params()
    assert report.estimate.local_params == params  # the planner's memory model counts alike
    with pytest.raises(ConfigError, match="model.n_kv_heads = 4 does not divide"):
        validate(load_config("debug", {"model.n_heads": 6, "model.n_kv_heads": 4,
                                       "model.head_dim": 32}), 1, None)


# DeepSeek-V3's shape in small: latent attention with a compressed query, 4 sigmoid-routed
# experts in 2 groups with a routed scale and a shared expert, the first block dense.
DEEPSEEK = {"model.n_layers": 2, "model.attention": "mla", "model.q_lora_rank": 32,
            "model.kv_lora_rank": 24, "model.qk_nope_head_dim": 16, "model.qk_rope_head_dim": 8,
            "model.v_head_dim": 16, "model.n_experts": 4, "model.moe_top_k": 2,
            "model.moe_hidden_size": 64, "model.moe_shared_hidden": 64,
            "model.moe_router": "sigmoid", "model.moe_n_group": 2, "model.moe_topk_group": 1,
            "model.moe_routed_scale": 2.5, "model.moe_first_dense_layers": 1}


def test_a_deepseek_shape_declared_in_the_section_trains(tmp_path):
    trainer = Trainer(load_config("debug", {
        **DEEPSEEK, "training.steps": 2, "training.seq_len": 32, "training.global_batch_size": 2,
        "training.micro_batch_size": 1, "metrics.log_every": 1, "metrics.tensorboard": False,
        "job.output_dir": str(tmp_path)}))
    args = trainer.model.args
    assert (args.attention, args.q_lora_rank, args.moe_n_group, args.moe_routed_scale,
            args.moe_layers) == ("mla", 32, 2, 2.5, (1,))
    attention = trainer.model.layers["0"].attention
    assert attention.wkv_a.weight.shape == (24 + 8, 256)
    assert [r["step"] for r in trainer.train()] == [1, 2]
    assert model_args_of(load_config(trainer.run_dir / "config.toml").model,
                         trainer.grad_accum) == args


@pytest.mark.parametrize(("change", "message"), [
    ({"model.kv_lora_rank": None},
     "model.attention = 'mla' needs model.kv_lora_rank: set them"),
    ({"model.moe_router": "softmax"},
     "model.moe_n_group = 2 needs model.moe_router = 'sigmoid'"),
    ({"model.moe_n_group": 3}, "model.moe_n_group = 3 does not split model.n_experts = 4"),
    ({"model.moe_topk_group": 3}, "model.moe_topk_group = 3 must be at most moe_n_group = 2"),
], ids=["mla-widths", "groups-softmax", "groups-split", "topk-group"])
def test_a_deepseek_shape_that_cannot_be_built_is_one_line(change, message):
    overrides = {k: v for k, v in {**DEEPSEEK, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(load_config("debug", overrides), 1, None)


def test_model_hf_config_reads_a_deepseek_v3_config(tmp_path):
    from transformers import DeepseekV3Config

    from dtrain.hf_deepseek import deepseek_v3_args

    config = DeepseekV3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                              qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4,
                              num_experts_per_tok=2, n_group=2, topk_group=1,
                              first_k_dense_replace=1, moe_intermediate_size=32,
                              intermediate_size=96, vocab_size=4096)
    config.save_pretrained(tmp_path)
    args = model_args_of(load_config("debug", {"model.hf_config": str(tmp_path)}).model)
    expected = deepseek_v3_args(json.loads((tmp_path / "config.json").read_text()))
    assert (args.attention, args.q_lora_rank, args.n_experts, args.moe_layers) == (
        "mla", None, 4, (1,))
    assert dataclasses.replace(args, rope_kernel=expected.rope_kernel) == expected
