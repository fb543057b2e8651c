"""Pipeline parallel over gloo reproduces the single-process run with every schedule: equal
initial weights, per-step losses and gradient norms within 1e-5 relative over 4 steps (8
microbatches per step), alone and composed with FSDP and TP."""

import pytest
from conftest import BASE, assert_same_run, run_distributed

from dtrain.config import ConfigError
from dtrain.parallel.pipeline import (
    check_pipeline,
    ideal_bubble,
    parse_layout,
    stages_of_rank,
)

FOUR = {**BASE, "model.n_layers": 4}


def specs(tmp_path, parallel: dict, variants: list[dict]) -> list[dict]:
    return [{**FOUR, **parallel, **variant, "job.name": f"run{i}",
             "job.output_dir": str(tmp_path)} for i, variant in enumerate(variants)]


SCHEDULE_VARIANTS = [
    {"parallel.pp_schedule": "GPipe"},
    {"parallel.pp_schedule": "1F1B"},
    {"parallel.pp_schedule": "1F1B", "activation_checkpoint.mode": "op"},
    *({"parallel.pp_schedule": name, "parallel.pp_virtual_stages": 2}
      for name in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                   "DualPipeV")),
    # Embedding and output layer on stages of their own.
    {"parallel.pp_schedule": "Interleaved1F1B", "parallel.pp_virtual_stages": 2,
     "parallel.pp_layout": "E|t*2|t*2|L"},
]


@pytest.mark.parametrize("nproc, parallel, variants", [
    (2, {"parallel.pp": 2, "parallel.dp_shard": 1}, SCHEDULE_VARIANTS),
    # One 4-rank launch: PP 2 x FSDP 2, then PP 2 x TP 2.
    (4, {"parallel.pp": 2},
     [{"parallel.dp_shard": 2, "parallel.pp_schedule": "1F1B"},
      {"parallel.dp_shard": 2, "parallel.pp_schedule": "Interleaved1F1B",
       "parallel.pp_virtual_stages": 2},
      {"parallel.tp": 2, "parallel.dp_shard": 1, "parallel.pp_schedule": "1F1B"},
      {"parallel.tp": 2, "parallel.dp_shard": 1, "parallel.pp_schedule": "ZBVZeroBubble",
       "parallel.pp_virtual_stages": 2}]),
], ids=["pp2-schedules", "pp2xfsdp2-pp2xtp2"])
def test_pipeline_matches_single_process(tmp_path, reference_4_layers, nproc, parallel,
                                         variants):
    runs = run_distributed(tmp_path, nproc, specs(tmp_path, parallel, variants))
    for run, variant in zip(runs, variants, strict=True):
        assert_same_run(run, reference_4_layers, f"{parallel} {variant}")


def test_even_split_gives_the_first_stages_the_remainder():
    specs_ = parse_layout("", n_layers=10, num_stages=4)
    assert [s.layers for s in specs_] == [(0, 1, 2), (3, 4, 5), (6, 7), (8, 9)]
    assert [s.embedding for s in specs_] == [True, False, False, False]
    assert [s.output for s in specs_] == [False, False, False, True]


def test_explicit_layout_like_megatron():
    specs_ = parse_layout("E|t*3|t,t*2|t*2,L", n_layers=8, num_stages=4)
    assert [s.layers for s in specs_] == [(), (0, 1, 2), (3, 4, 5), (6, 7)]
    assert specs_[0].embedding and specs_[3].output


@pytest.mark.parametrize("layout, message", [
    ("E,t*2|t*2,L", "has 2 stages and 4 layers; this run needs 4 stages"),
    ("E,t*2|t|t|t,L", "has 4 stages and 5 layers"),
    ("t|E,t|t|t,L", "E must be in the first stage only"),
    ("E|t*2|x|t*2,L", "unknown item 'x'"),
])
def test_bad_layouts_are_config_errors(layout, message):
    with pytest.raises(ConfigError, match=message):
        parse_layout(layout, n_layers=4, num_stages=4)


def test_stage_placement_looped_and_v_shaped():
    assert stages_of_rank(0, 4, 2, "Interleaved1F1B") == [0, 4]
    assert stages_of_rank(3, 4, 2, "Interleaved1F1B") == [3, 7]
    assert stages_of_rank(0, 4, 2, "ZBVZeroBubble") == [0, 7]
    assert stages_of_rank(3, 4, 2, "DualPipeV") == [3, 4]


@pytest.mark.parametrize("schedule, virtual, micro, message", [
    ("Zigzag", 1, 8, "is not a schedule"),
    ("1F1B", 2, 8, "runs one stage per rank"),
    ("ZBVZeroBubble", 1, 8, "runs two stages per rank in a V"),
    ("1F1B", 1, 2, "gets 2 microbatches per step, fewer than parallel.pp = 4"),
    ("Interleaved1F1B", 2, 6, "needs the microbatches \\(6\\) to be a multiple"),
])
def test_impossible_pipelines_are_config_errors(schedule, virtual, micro, message):
    with pytest.raises(ConfigError, match=message):
        check_pipeline(schedule, pp=4, virtual=virtual, microbatches=micro)


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_split_backward_schedules_refuse_compile(schedule):
    with pytest.raises(ConfigError, match="set compile.enabled = false"):
        check_pipeline(schedule, pp=2, virtual=2, microbatches=8, compiled=True)
    check_pipeline(schedule, pp=2, virtual=2, microbatches=8, compiled=False)
    check_pipeline("Interleaved1F1B", pp=2, virtual=2, microbatches=8, compiled=True)


def test_ideal_bubble():
    assert ideal_bubble("1F1B", pp=4, virtual=1, microbatches=12) == pytest.approx(3 / 12)
    assert ideal_bubble("Interleaved1F1B", 4, 2, 12) == pytest.approx(3 / 24)
    assert ideal_bubble("ZBVZeroBubble", 4, 2, 12) == pytest.approx(3 / 72)
