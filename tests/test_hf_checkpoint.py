"""HF transformers LLaMA, Qwen3 and Mixtral checkpoints: import gives HF's logits and a recipe
whose run starts from them, export loads in transformers with the same logits, and damaged
folders are clear errors."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

import dtrain.assets
from dtrain import Trainer, convert_hf, load_config
from dtrain.config import ConfigError
from dtrain.data.loader import DataLoader, build_text_dataset
from dtrain.hf_checkpoint import export_hf, import_hf, load_model

# fp32 on CPU: the two implementations differ only in the order of float operations.
ATOL = 1e-4


def tiny_hf(folder, tied: bool, vocab: int = 256):
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=tied,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="60KB")  # sharded
    return model


def assert_round_trip(hf, tmp_path, args):
    """The imported checkpoint in ``tmp_path / "ckpt"`` gives ``hf``'s logits; its export to
    ``tmp_path / "out"`` loads in transformers and gives them too. Returns the loaded model."""
    ours = load_model(tmp_path / "ckpt", args).eval()
    tokens = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        want = hf(tokens).logits
        got = ours(tokens)
    assert (got - want).abs().max().item() < ATOL

    export_hf(ours, tmp_path / "out", torch.float32)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        again = back(tokens).logits
    assert (again - want).abs().max().item() < ATOL
    return back


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_import_matches_hf_logits_and_export_loads_in_transformers(tmp_path, tied):
    hf = tiny_hf(tmp_path / "hf", tied)
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    back = assert_round_trip(hf, tmp_path, import_hf(tmp_path / "hf", tmp_path / "ckpt"))
    assert isinstance(back, transformers.LlamaForCausalLM)


# A shape no preset has (Qwen3: qk-norm, head_dim 10 for hidden 48 / 6 heads, GQA), with the
# debug tokenizer's 4096 ids; every parameter random, norms and all.
QWEN3 = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=10,
             intermediate_size=64, num_hidden_layers=2, vocab_size=4096,
             max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1e6)
TINY_RUN = {"training.steps": 5, "training.seq_len": 32, "training.global_batch_size": 2,
            "training.micro_batch_size": 1, "metrics.tensorboard": False,
            "metrics.log_every": 1, "data.tokenizer": "builtin:debug/tokenizer.json"}


def imported_qwen3(tmp_path, capsys, tokenizer: bool = False):
    """A random Qwen3 (with the debug tokenizer.json where ``tokenizer``) imported by ``python -m
    dtrain.convert_hf import`` into tmp_path / "ckpt"; returns the transformers model and what
    the command printed."""
    config = transformers.Qwen3Config(**QWEN3)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "hf")
    if tokenizer:
        shutil.copy(Path(dtrain.assets.__file__).parent / "debug" / "tokenizer.json",
                    tmp_path / "hf")
    assert convert_hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    return hf.eval(), capsys.readouterr().out


def test_an_import_writes_a_recipe_that_trains_from_the_imported_weights(tmp_path, capsys):
    hf, printed = imported_qwen3(tmp_path, capsys)
    recipe = tmp_path / "ckpt" / "recipe.toml"
    assert f"python -m dtrain.train --recipe {recipe}" in printed
    cfg = load_config(recipe, {**TINY_RUN, "job.output_dir": str(tmp_path / "runs")})
    trainer = Trainer(cfg)
    first = trainer.train()[0]["loss"]
    # The same first two windows (two micro-batches of one), read by a fresh loader.
    data = build_text_dataset(cfg.data, trainer.tokenizer, 32)
    inputs, labels = DataLoader(data, 2, seed=cfg.training.seed).next_batch()
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(hf(inputs).logits.flatten(0, 1),
                                                 labels.flatten()).item()
    # fp32 on CPU: the two sides differ only in the order of float operations.
    assert first == pytest.approx(want, rel=1e-5)


def test_the_recipe_of_an_import_names_the_model_tokenizer_and_weights(tmp_path, capsys):
    imported_qwen3(tmp_path, capsys, tokenizer=True)
    out = tmp_path / "ckpt"
    cfg = load_config(out / "recipe.toml")
    assert cfg.model.hf_config == str(out / "hf_config.json")
    assert json.loads((out / "hf_config.json").read_text())["head_dim"] == 10
    assert cfg.checkpoint.initial_weights == str(out)
    assert cfg.data.tokenizer == str(tmp_path / "hf")
    assert cfg.training.seq_len == 64  # the model's longest sequence, below dtrain's default


def test_the_start_up_says_where_the_weights_came_from(tmp_path, capsys):
    imported_qwen3(tmp_path, capsys)
    out = tmp_path / "ckpt"
    Trainer(load_config(out / "recipe.toml", {**TINY_RUN, "job.output_dir": str(tmp_path)}))
    lines = capsys.readouterr().out.splitlines()
    assert any(str(out) in line and "weights" in line for line in lines), lines


def test_missing_shard_and_damaged_file_are_clear_errors(tmp_path):
    tiny_hf(tmp_path / "hf", tied=False)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    shard = tmp_path / "hf" / first
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match=f"{first} cannot be read"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")
    shard.unlink()
    with pytest.raises(ConfigError, match=f"{first} is listed in model.safetensors.index.json "
                                          "but missing"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")


def test_non_llama_config_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="only LlamaForCausalLM, MistralForCausalLM"):
        import_hf(tmp_path, tmp_path / "ckpt")


def test_initial_weights_of_another_shape_are_refused(tmp_path):
    tiny_hf(tmp_path / "hf", tied=False)
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    cfg = load_config("debug", {"training.steps": 1, "metrics.tensorboard": False,
                                "job.output_dir": str(tmp_path),
                                "checkpoint.initial_weights": str(tmp_path / "ckpt")})
    with pytest.raises(ConfigError, match="initial_weights = .* cannot be loaded"):
        Trainer(cfg)


def test_the_command_line_round_trip_of_an_imported_checkpoint(tmp_path):
    import subprocess
    import sys

    from conftest import ROOT

    def tool(*args):
        return subprocess.run([sys.executable, "-m", "dtrain.convert_hf", *map(str, args)],
                              capture_output=True, text=True, cwd=ROOT, timeout=300)

    hf = tiny_hf(tmp_path / "hf", tied=False)
    assert tool("import", tmp_path / "hf", tmp_path / "ckpt").returncode == 0
    done = tool("export", tmp_path / "ckpt", tmp_path / "out", "--dtype", "fp32")
    assert done.returncode == 0, done.stderr
    tokens = torch.randint(0, 256, (1, 16))
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert (back(tokens).logits - hf(tokens).logits).abs().max().item() < ATOL
    alone = tmp_path / "alone"  # neither a run's nor an imported checkpoint
    alone.mkdir()
    missing = tool("export", alone, tmp_path / "out2")
    assert missing.returncode == 2 and "name the model with --model" in missing.stderr


def test_mixtral_import_matches_hf_logits_and_export_loads_in_transformers(tmp_path):
    config = transformers.MixtralConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=1e6)
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True, max_shard_size="60KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    args = import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert (args.n_experts, args.moe_top_k, args.expert_dim) == (4, 2, 96)
    back = assert_round_trip(hf, tmp_path, args)
    assert isinstance(back, transformers.MixtralForCausalLM)
