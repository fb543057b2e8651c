"""HF transformers LLaMA and Mixtral checkpoints: import gives HF's logits, export loads in
transformers with the same logits, a run starts from imported weights, and damaged folders are
clear errors."""

import json

import pytest
import torch
import transformers

from dtrain import Trainer, load_config
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


def test_a_run_starts_from_imported_weights(tmp_path):
    # The debug model's shape as an HF model: the run's first loss equals HF's on that batch.
    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=704, num_hidden_layers=1, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=4096, max_position_embeddings=2048, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    cfg = load_config("debug", {"model.n_layers": 1, "training.seq_len": 64,
                                "training.global_batch_size": 1, "training.micro_batch_size": 1,
                                "training.steps": 1, "metrics.log_every": 1,
                                "metrics.tensorboard": False, "job.output_dir": str(tmp_path),
                                "checkpoint.initial_weights": str(tmp_path / "ckpt")})
    trainer = Trainer(cfg)
    first = trainer.train()[0]["loss"]
    # The same first window, read by a fresh loader.
    data = build_text_dataset(cfg.data, trainer.tokenizer, 64)
    inputs, labels = DataLoader(data, 1, seed=cfg.training.seed).next_batch()
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(hf(inputs).logits.flatten(0, 1),
                                                 labels.flatten()).item()
    assert first == pytest.approx(want, rel=1e-5)


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


def test_convert_tool_round_trip_and_export_of_a_training_checkpoint(tmp_path):
    import subprocess
    import sys

    from conftest import ROOT

    def tool(*args):
        return subprocess.run([sys.executable, "tools/convert_hf.py", *map(str, args)],
                              capture_output=True, text=True, cwd=ROOT, timeout=300)

    hf = tiny_hf(tmp_path / "hf", tied=False)
    assert tool("import", tmp_path / "hf", tmp_path / "ckpt").returncode == 0
    done = tool("export", tmp_path / "ckpt", tmp_path / "out", "--dtype", "fp32")
    assert done.returncode == 0, done.stderr
    tokens = torch.randint(0, 256, (1, 16))
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert (back(tokens).logits - hf(tokens).logits).abs().max().item() < ATOL
    # A training checkpoint (model + optimizer + ...) exports its model by preset name.
    cfg = load_config("debug", {"model.n_layers": 1, "training.seq_len": 64,
                                "training.global_batch_size": 1, "training.steps": 1,
                                "training.micro_batch_size": 1, "metrics.tensorboard": False,
                                "checkpoint.enabled": True,
                                "job.output_dir": str(tmp_path)})
    trainer = Trainer(cfg)
    trainer.train()
    step = tmp_path / "debug" / "checkpoints" / "step-0000001"
    missing = tool("export", step, tmp_path / "out2")
    assert missing.returncode == 2 and "name the model with --model" in missing.stderr
    # --model llama3_debug has 4 layers; this run trained 1: the shapes disagree.
    wrong = tool("export", step, tmp_path / "out2", "--model", "llama3_debug")
    assert wrong.returncode == 2
    assert "as a 4-layer model of dim 256 cannot be loaded" in wrong.stderr
    right = tool("export", step, tmp_path / "out2", "--model", "llama3_debug", "--n-layers", 1,
                 "--dtype", "fp32")
    assert right.returncode == 0, right.stderr
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out2").eval()
    tokens = torch.randint(0, 4096, (1, 16))
    with torch.no_grad():
        assert (exported(tokens).logits - trainer.model(tokens)).abs().max().item() < ATOL


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
