"""A Megatron-LM command line in, a dtrain recipe out: the two example launch scripts (Llama 3 70B
on 64 GPUs with TP 4 x PP 4; Mixtral 8x7B on 32 GPUs with TP 2 x EP 4) translate and pass the
dry run at their world sizes; every flag that cannot be mapped is listed with its reason."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dtrain.from_megatron import translate
from dtrain.megatron_script import Command, read_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "megatron"
TOKENIZER = ROOT / "dtrain" / "assets" / "debug"


def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin"})


@pytest.fixture(scope="module")
def indexed_data(tmp_path_factory):
    """Two small Megatron datasets (.bin/.idx) of the debug corpus, written by preprocess_data."""
    folder = tmp_path_factory.mktemp("megatron_data")
    lines = (TOKENIZER / "corpus.jsonl").read_text().splitlines()
    prefixes = []
    for name, part in (("a", lines[:300]), ("b", lines[300:600])):
        (folder / f"{name}.jsonl").write_text("\n".join(part) + "\n")
        result = run("-m", "dtrain.preprocess_data", "--input", str(folder / f"{name}.jsonl"),
                     "--output-prefix", str(folder / name), "--tokenizer", str(TOKENIZER),
                     "--append-eod")
        assert result.returncode == 0, result.stderr
        prefixes.append(str(folder / f"{name}_text_document"))
    return prefixes


def translated(script: str, tmp_path: Path, env: dict[str, str]) -> tuple[dict, Path, str]:
    given = [a for name, value in env.items() for a in ("--env", f"{name}={value}")]
    result = run("-m", "dtrain.from_megatron", str(SCRIPTS / script), *given)
    assert result.returncode == 0, result.stderr
    recipe = tmp_path / f"{script}.toml"
    recipe.write_text(result.stdout)
    return tomllib.loads(result.stdout), recipe, result.stderr


def dry_run(recipe: Path, world: int, tmp_path: Path) -> subprocess.CompletedProcess:
    return run("-m", "dtrain.train", "--recipe", str(recipe), "--dry-run",
               "--dry-run-world-size", str(world), "--job.output_dir", str(tmp_path / "out"),
               "--checkpoint.folder", str(tmp_path / "ckpt"))


def test_llama3_70b_on_64_gpus_translates_and_dry_runs(indexed_data, tmp_path):
    recipe, path, stderr = translated("train_llama3_70b.sh", tmp_path, {
        "DATA_PATH": indexed_data[0], "TOKENIZER_MODEL": str(TOKENIZER)})
    model, parallel = recipe["model"], recipe["parallel"]
    assert (model["n_layers"], model["hidden_size"], model["n_heads"], model["n_kv_heads"],
            model["ffn_hidden_size"], model["rope_theta"], model["tie_embeddings"]) == (
        80, 8192, 64, 8, 28672, 500000.0, False)
    assert (parallel["tp"], parallel["pp"], parallel["pp_virtual_stages"],
            parallel["pp_schedule"]) == (4, 4, 4, "Interleaved1F1B")
    assert recipe["training"]["global_batch_size"] == 1024
    assert (recipe["lr_schedule"]["decay"], recipe["lr_schedule"]["decay_steps"]) == (
        "cosine", 480000)
    assert recipe["activation_checkpoint"]["mode"] == "op"  # --recompute-granularity selective
    assert "--nnodes 8 --nproc_per_node 8" in path.read_text()
    # the only flag not followed: inside `if [ -n "${WANDB_API_KEY}" ]`
    assert stderr.splitlines() == [
        "not mapped: --eval-interval: dtrain's validation does not run under a pipeline "
        "(parallel.pp > 1): left off",
        "not mapped: --wandb-project: inside a conditional block of the script, not followed"]
    result = dry_run(path, 64, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "tp 4" in result.stdout and "pp 4" in result.stdout, result.stdout


def test_mixtral_8x7b_on_32_gpus_translates_and_dry_runs(indexed_data, tmp_path):
    blend = f"0.5 {indexed_data[0]} 0.5 {indexed_data[1]}"
    recipe, path, stderr = translated("train_mixtral_8x7b.sh", tmp_path, {
        "DATA_PATH": blend, "TOKENIZER_MODEL": str(TOKENIZER)})
    model, parallel = recipe["model"], recipe["parallel"]
    assert (model["n_experts"], model["moe_top_k"], model["moe_aux_loss_coeff"],
            model["ffn_hidden_size"], model["n_kv_heads"]) == (8, 2, 0.01, 14336, 8)
    assert (parallel["tp"], parallel["pp"], parallel["ep"]) == (2, 1, 4)
    assert recipe["data"]["path"] == blend and recipe["data"]["source"] == "indexed"
    assert stderr == ""
    result = dry_run(path, 32, tmp_path)
    assert result.returncode == 0, result.stderr


def test_flags_without_an_equivalent_are_listed_with_the_reason(tmp_path):
    out = translate(Command(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
                             "4", "--normalization", "LayerNorm", "--hidden-dropout", "0.1",
                             "--mock-data", "--optimizer", "sgd", "--no-such-flag", "3"]))
    assert out.unmapped == [
        "--normalization LayerNorm: dtrain's blocks use RMSNorm",
        "--hidden-dropout 0.1: dtrain trains without dropout",
        "--mock-data: dtrain trains on real data: set data.path",
        "--optimizer sgd: dtrain trains with AdamW",
        "--no-such-flag 3: no dtrain equivalent"]
    # Megatron's defaults where the base differs: tied, MHA, its FFN rule, fp32 without --bf16
    assert (out.keys["model.tie_embeddings"], out.keys["model.n_kv_heads"],
            out.keys["model.ffn_hidden_size"], out.keys["training.mixed_precision"]) == (
        True, 4, 128, "fp32")


def test_the_command_line_form_and_megatron_s_schedule_arithmetic():
    out = translate(Command(["--num-layers", "4", "--global-batch-size", "8",
                             "--train-samples", "800", "--lr-warmup-fraction", "0.1",
                             "--moe-layer-freq", "([0]*1+[1]*3)", "--num-experts", "4"]))
    assert (out.keys["training.steps"], out.keys["lr_schedule.warmup_steps"],
            out.keys["model.moe_first_dense_layers"]) == (100, 10, 1)


def test_a_script_without_pretrain_gpt_is_one_line(tmp_path):
    script = tmp_path / "other.sh"
    script.write_text("echo hello\n")
    result = run("-m", "dtrain.from_megatron", str(script))
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: no line of the script runs pretrain_gpt.py: give the "
                                     "script that launches it, or its arguments after --")
    command = read_script("A=3\nB=${C:-$((A*4))}\nARGS=(\n  --x $B  # note\n)\n"
                          "python pretrain_gpt.py ${ARGS[@]} --y \"two words\"\n")
    assert command.args == ["--x", "12", "--y", "two words"]
    assert json.dumps(command.args)


def test_deepseek_v3_s_flags_map_onto_the_model_section():
    out = translate(Command(["--multi-latent-attention", "--q-lora-rank", "1536",
                             "--kv-lora-rank", "512", "--qk-head-dim", "128",
                             "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128",
                             "--moe-router-score-function", "sigmoid",
                             "--moe-router-num-groups", "8", "--moe-router-group-topk", "4",
                             "--moe-router-topk-scaling-factor", "2.5",
                             "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3"]))
    assert out.unmapped == []
    assert (out.keys["model.mtp_depths"], out.keys["model.mtp_loss_weight"]) == (1, 0.3)
    assert {k: out.keys[k] for k in ("model.attention", "model.q_lora_rank", "model.kv_lora_rank",
                                     "model.qk_nope_head_dim", "model.qk_rope_head_dim",
                                     "model.v_head_dim", "model.moe_router", "model.moe_n_group",
                                     "model.moe_topk_group", "model.moe_routed_scale")} == {
        "model.attention": "mla", "model.q_lora_rank": 1536, "model.kv_lora_rank": 512,
        "model.qk_nope_head_dim": 128, "model.qk_rope_head_dim": 64, "model.v_head_dim": 128,
        "model.moe_router": "sigmoid", "model.moe_n_group": 8, "model.moe_topk_group": 4,
        "model.moe_routed_scale": 2.5}


@pytest.mark.parametrize("value, keys, unmapped", [
    ("seq_aux_loss", {"model.moe_aux_loss_type": "seq_aux_loss"}, []),
    ("aux_loss", {"model.moe_aux_loss_type": "aux_loss"}, []),
    ("none", {"model.moe_aux_loss_coeff": 0.0}, []),
    ("sinkhorn", {}, ["--moe-router-load-balancing-type sinkhorn: dtrain's load-balancing "
                      "losses are aux_loss and seq_aux_loss (model.moe_aux_loss_type), or none"]),
], ids=["seq_aux_loss", "aux_loss", "none", "sinkhorn"])
def test_the_load_balancing_type_maps_onto_moe_aux_loss_type(tmp_path, value, keys, unmapped):
    from dtrain import load_config
    from dtrain.from_megatron import recipe

    out = translate(Command(["--num-experts", "8", "--moe-aux-loss-coeff", "0.001",
                             "--moe-router-load-balancing-type", value]))
    assert out.unmapped == unmapped
    assert {k: out.keys[k] for k in keys} == keys
    assert out.keys["model.moe_aux_loss_coeff"] == (0.0 if value == "none" else 0.001)
    path = tmp_path / "recipe.toml"
    path.write_text(recipe(out, "command line"))
    # the recipe's key is the [model] section's; without one, Megatron's aux_loss is the default
    expected = keys.get("model.moe_aux_loss_type", "preset")
    assert load_config(path).model.moe_aux_loss_type == expected


@pytest.mark.parametrize("recipe, keys", [
    ("blockwise", ("torchao", "blockwise")), ("tensorwise", ("torchao", "tensorwise")),
    ("delayed", ("te", "delayed"))])
def test_megatron_s_fp8_recipes_map_onto_a_backend_and_recipe(recipe, keys):
    out = translate(Command(["--fp8-format", "hybrid", "--fp8-recipe", recipe]))
    assert out.unmapped == []
    assert (out.keys["fp8.backend"], out.keys["fp8.recipe"]) == keys
