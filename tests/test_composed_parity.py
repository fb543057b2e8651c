"""Composed layouts over 8 gloo processes reproduce the single-process run (fp32: equal initial
weights, per-step losses and gradient norms within 1e-5 relative): TP 2 x PP 2 x FSDP 2,
TP 2 x CP 2 x FSDP 2, PP 2 x TP 2 x CP 2 on the dense model, and EP 8 and EP 4 x TP 2 on the
MoE model. One launch runs them all, one after another."""

import pytest
from conftest import BASE, MOE, REL, assert_same_run, run_distributed

DENSE = [
    {"parallel.tp": 2, "parallel.pp": 2, "parallel.dp_shard": 2},
    {"parallel.tp": 2, "parallel.cp": 2, "parallel.dp_shard": 2},
    {"parallel.pp": 2, "parallel.tp": 2, "parallel.cp": 2, "parallel.dp_shard": 1},
]
MIXTURE = [
    {"parallel.ep": 8},
    {"parallel.ep": 4, "parallel.tp": 2, "parallel.dp_shard": 4},
]


def test_composed_layouts_over_eight_ranks(tmp_path, reference, moe_reference):
    specs = [{**BASE, **layout} for layout in DENSE] + [{**MOE, **layout} for layout in MIXTURE]
    specs = [{**spec, "job.name": f"run{i}", "job.output_dir": str(tmp_path)}
             for i, spec in enumerate(specs)]
    runs = run_distributed(tmp_path, 8, specs)
    for run, layout in zip(runs, DENSE, strict=False):
        assert_same_run(run, reference, str(layout))
    for run, layout in zip(runs[len(DENSE):], MIXTURE, strict=True):
        assert_same_run(run, moe_reference, str(layout))
        for ref, got in zip(moe_reference, run["history"], strict=True):
            assert got["aux_loss"] == pytest.approx(ref["aux_loss"], rel=REL), layout
