"""A shape no preset has, declared only in a TOML recipe (head width apart from hidden / heads,
GQA, QKV biases, QK-norm, YaRN), trains under FSDP 2, TP 2 and PP 2 as in one process: equal
initial weights, per-step losses and gradient norms within 1e-5 (fp32 on the CPU)."""

from conftest import assert_same_run, run_distributed

from dtrain import Trainer, load_config

SHAPE = """[model]
name = "llama3_debug"
n_layers = 2
hidden_size = 192
n_heads = 6
n_kv_heads = 2
head_dim = 40
ffn_hidden_size = 320
qkv_bias = true
qk_norm = true
rope_theta = 10000.0
rope_scaling = "yarn"
rope_scaling_factor = 2.0
rope_original_max_seq_len = 32
max_seq_len = 128

[training]
steps = 4
seq_len = 64
global_batch_size = 4
micro_batch_size = 1

[lr_schedule]
warmup_steps = 2

[metrics]
log_every = 1
tensorboard = false
"""
LAYOUTS = [{"parallel.dp_shard": 2}, {"parallel.tp": 2, "parallel.dp_shard": 1},
           {"parallel.pp": 2, "parallel.dp_shard": 1}]


def test_a_toml_declared_shape_trains_alike_under_fsdp_tp_and_pp(tmp_path):
    recipe = tmp_path / "shape.toml"
    recipe.write_text(SHAPE)
    reference = Trainer(load_config(recipe, {"job.output_dir": str(tmp_path / "ref")})).train()
    assert len(reference) == 4
    specs = [{**layout, "_recipe": str(recipe), "job.name": f"run{i}",
              "job.output_dir": str(tmp_path)} for i, layout in enumerate(LAYOUTS)]
    for run, layout in zip(run_distributed(tmp_path, 2, specs), LAYOUTS, strict=True):
        assert_same_run(run, reference, str(layout))
