"""Context parallel over gloo reproduces the single-process run: equal initial weights, per-step
losses and gradient norms within 1e-5 relative over 5 steps at seq_len 256, with each attention
comm type at CP 2 and CP 4, and composed with FSDP (and activation checkpointing), TP and PP;
over 2 steps with DeepSeek-V3's multi-head latent attention at CP 2. Plus the attention function
alone against whole-sequence causal attention (grouped-query heads, and MLA's value width and
softmax scale), and the errors."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BASE, PYTHONPATH, REL, ROOT, assert_same_run, run_distributed

from dtrain import Trainer, load_config
from dtrain.config import ConfigError
from dtrain.models import model_args
from dtrain.parallel.context import COMM_TYPES, check_cp, load_balanced_positions

# Sequences long enough for 2 x 4 chunks of 32 tokens; max_norm 0.5 so clipping acts every step
# and a wrong gradient norm would change the updates.
CP_BASE = {**BASE, "training.seq_len": 256, "training.global_batch_size": 2,
           "training.steps": 5, "training.max_norm": 0.5}


@pytest.fixture(scope="module")
def reference_256(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref256")
    return Trainer(load_config("debug", {**CP_BASE, "job.output_dir": str(out)})).train()


def specs(tmp_path, layouts: list[dict]) -> list[dict]:
    return [{**CP_BASE, **layout, "job.name": f"run{i}", "job.output_dir": str(tmp_path)}
            for i, layout in enumerate(layouts)]


CP2 = [{"parallel.cp": 2, "parallel.dp_shard": 1, "parallel.cp_comm_type": c}
       for c in COMM_TYPES]
FOUR_RANKS = [
    *({"parallel.cp": 4, "parallel.dp_shard": 1, "parallel.cp_comm_type": c}
      for c in COMM_TYPES),
    # FSDP over dp_shard x cp = 4 ranks, 2 of them reading different data.
    {"parallel.cp": 2, "parallel.dp_shard": 2, "activation_checkpoint.mode": "op"},
    {"parallel.cp": 2, "parallel.tp": 2, "parallel.dp_shard": 1,
     "activation_checkpoint.mode": "full"},
    # Pipeline stages hold this rank's positions; 2 microbatches of one sequence.
    {"parallel.cp": 2, "parallel.pp": 2, "parallel.dp_shard": 1,
     "training.micro_batch_size": 1, "parallel.pp_schedule": "1F1B"},
]


@pytest.mark.parametrize("nproc, layouts", [(2, CP2), (4, FOUR_RANKS)],
                         ids=["cp2-comm-types", "cp4-cp2xfsdp2-cp2xtp2-cp2xpp2"])
def test_context_parallel_matches_single_process(tmp_path, reference_256, nproc, layouts):
    runs = run_distributed(tmp_path, nproc, specs(tmp_path, layouts))
    for run, layout in zip(runs, layouts, strict=True):
        assert_same_run(run, reference_256, str(layout))
        assert run["compute_dtype"] == "torch.float32"


# Tolerances of the attention alone, per case of cp_attention_runner.py. gqa: float64 on every
# rank, only the order of sums differs from one process, so the outputs and gradients agree to
# ~1e-15; 1e-12 leaves room and still catches any masking error. mla: float32, ~1e-7 of the
# largest value; 1e-5 catches a wrong scale, mask or value width.
ATTENTION_TOLERANCE = {"gqa": 1e-12, "mla": 1e-5}


@pytest.mark.parametrize("cp", [2, 4])  # cp 4: every kind of ring block
def test_attention_matches_whole_sequence_causal_attention(tmp_path, cp):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cp}",
         str(ROOT / "tests" / "cp_attention_runner.py"), str(tmp_path / "out.json")],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    by_case = json.loads((tmp_path / "out.json").read_text())
    assert set(by_case) == set(ATTENTION_TOLERANCE)
    for case, errors in by_case.items():
        assert set(errors) == set(COMM_TYPES)
        for comm_type, by_output in errors.items():
            label = (case, comm_type)
            # The operator's fake (compiler) implementation, schema and autograd registration
            # agree with the real one.
            assert by_output.pop("opcheck") == ["SUCCESS"] * 4, label
            # Full checkpointing runs the attention again in backward; the selective (op)
            # policy keeps its outputs, so neither attention nor its communication is repeated.
            assert by_output.pop("recomputed") == {"full": 1, "op": 0}, label
            assert set(by_output) == {"out", "dq", "dk", "dv"}
            for name, error in by_output.items():
                assert error < ATTENTION_TOLERANCE[case], (*label, name, error)


def tiny_deepseek(folder: Path) -> str:
    """A DeepSeek-V3 config.json in ``folder`` with test_mla.py's tiny attention: 4 heads of
    query/key width 12 + 8 and value width 10, a query latent of 24, a key/value latent of 16,
    YaRN whose mscale_all_dim moves the softmax scale away from 1 / sqrt(20). Two dense blocks
    (no routed experts: the attention is under test), one multi-token prediction depth (its
    block's attention is context parallel too) and the debug tokenizer's vocabulary."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v3", "vocab_size": 4096, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "n_routed_experts": 0, "n_group": 1, "topk_group": 1,
        "first_k_dense_replace": 2, "q_lora_rank": 24, "kv_lora_rank": 16,
        "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10, "rms_norm_eps": 1e-5,
        "attention_bias": True, "max_position_embeddings": 64, "num_nextn_predict_layers": 1,
        "rope_scaling": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "mscale": 0.8,
                         "mscale_all_dim": 1.0}}))
    return str(folder)


# 2 steps of 2 sequences of 64 tokens; max_norm 0.5 so clipping acts on both steps. Learning
# rate 0.1: from the initial 0.02-wide weights the attention logits are ~0.04, where the softmax
# scale moves the loss by less than 1e-6; after a first step of this size they are ~1, and a
# scale 1.3 times too small (the default's, for this YaRN) moves the second step's loss by
# ~7e-5 and its gradient norm by ~3e-3, well outside the 1e-5 compared.
MLA_CP = {**BASE, "training.steps": 2, "training.global_batch_size": 2,
          "lr_schedule.warmup_steps": 1, "training.max_norm": 0.5, "optimizer.lr": 0.1}


def test_mla_context_parallel_matches_single_process(tmp_path):
    # Values narrower than queries and keys, and YaRN's softmax scale, reach each comm type's
    # operator from the model (apply_cp reads every attention module's own scale).
    overrides = {**MLA_CP, "model.hf_config": tiny_deepseek(tmp_path / "model")}
    reference = Trainer(load_config("debug", {**overrides, "job.name": "one",
                                              "job.output_dir": str(tmp_path)})).train()
    layouts = [{"parallel.cp": 2, "parallel.dp_shard": 1, "parallel.cp_comm_type": c}
               for c in COMM_TYPES]
    runs = run_distributed(tmp_path, 2, [
        {**overrides, **layout, "job.name": f"run{i}", "job.output_dir": str(tmp_path)}
        for i, layout in enumerate(layouts)])
    for run, layout in zip(runs, layouts, strict=True):
        assert_same_run(run, reference, str(layout))


def test_load_balanced_chunks_cover_the_sequence_once():
    cp, seq = 4, 64
    shards = [load_balanced_positions(seq, cp, rank).tolist() for rank in range(cp)]
    assert shards[0] == [*range(0, 8), *range(56, 64)]
    assert shards[3] == [*range(24, 32), *range(32, 40)]
    assert sorted(p for shard in shards for p in shard) == list(range(seq))
    # Causal work (keys before each query) is equal on every rank.
    assert len({sum(p + 1 for p in shard) for shard in shards}) == 1


@pytest.mark.parametrize("cp, tp, seq_len, comm_type, message", [
    (2, 1, 254, "p2p", r"training.seq_len = 254 is not divisible by 2 x parallel.cp = 2 x 2 = 4"),
    (4, 2, 264, "p2p", r"not divisible by 2 x parallel.cp x parallel.tp = 2 x 4 x 2 = 16"),
    (3, 1, 258, "a2a", r"model's n_heads \(8\) is not divisible by 3"),
    (8, 1, 256, "a2a", r"model's n_kv_heads \(4\) is not divisible by 8"),
    (2, 4, 256, "a2a", r"n_kv_heads \(4 / tp = 1 per tensor-parallel rank\) is not divisible"),
])
def test_impossible_context_parallel_layouts(cp, tp, seq_len, comm_type, message):
    with pytest.raises(ConfigError, match=message):
        check_cp(model_args("llama3_debug"), cp, tp, seq_len, comm_type)


def test_a2a_with_dividing_heads_and_p2p_with_any_heads_are_accepted():
    model = model_args("llama3_debug")  # 8 heads, 4 KV heads
    check_cp(model, 2, 2, 256, "a2a")
    check_cp(model, 3, 1, 258, "p2p")


def test_mla_is_accepted_and_a2a_splits_its_heads_alone():
    # MLA expands keys and values to every query head: n_kv_heads (the preset's 4) is unused.
    mla = dataclasses.replace(model_args("llama3_debug"), attention="mla", n_heads=8,
                              n_kv_heads=4, kv_lora_rank=16, qk_nope_head_dim=12,
                              qk_rope_head_dim=8, v_head_dim=10)
    for comm_type in COMM_TYPES:
        check_cp(mla, 8, 1, 256, comm_type)
    with pytest.raises(ConfigError, match=r"model's n_heads \(8\) is not divisible by 16"):
        check_cp(mla, 16, 1, 256, "a2a")


def test_unknown_comm_type_is_a_config_error():
    with pytest.raises(ConfigError, match="parallel.cp_comm_type = 'ring' is not a valid "
                                          "choice: use one of p2p, all_gather, a2a"):
        load_config("debug", {"parallel.cp_comm_type": "ring"})


assert REL == 1e-5  # the tolerance the module docstring states
