"""tools/trace_summary.py on a hand-built Chrome trace whose answers are known."""

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "trace_summary", Path(__file__).resolve().parent.parent / "tools" / "trace_summary.py")
trace_summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trace_summary)


def kernel(name, ts, dur, device=0):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
            "args": {"device": device, "stream": 7}}


def write(path: Path, events) -> Path:
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_busy_idle_categories_and_steps(tmp_path):
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#4", "ts": 0, "dur": 500},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#5", "ts": 500, "dur": 500},
        kernel("nvjet_tst_128x256_gemm", 0, 300),
        kernel("ncclDevKernel_AllGather_RING_LL", 100, 700),   # overlaps; not compute
        kernel("triton_poi_fused_mul_silu_0", 200, 200),      # overlaps the matmul
        kernel("cudnn_sdpa_fprop", 500, 100),                 # after a 100 us gap
        kernel("void at::native::_chunk_cat_kernel", 900, 100),  # after a 300 us gap
        kernel("nvjet_tst_gemm_other_device", 0, 5000, device=1),  # another GPU: ignored
    ]
    s = trace_summary.summarize(write(tmp_path / "t.json.gz", events))
    assert s["steps"] == 2
    assert s["span_ms"] == pytest.approx(1000 / 2e3)
    assert s["compute_busy_ms"] == pytest.approx(600 / 2e3)       # 0-400, 500-600, 900-1000
    assert s["compute_idle_ms"] == pytest.approx(400 / 2e3)
    assert s["largest_gaps_ms"] == pytest.approx([0.3, 0.1])
    assert s["categories_ms"]["matmul"] == pytest.approx(300 / 2e3)
    assert s["categories_ms"]["attention"] == pytest.approx(100 / 2e3)
    assert s["categories_ms"]["fsdp copy"] == pytest.approx(100 / 2e3)
    assert s["categories_ms"]["fused triton"] == pytest.approx(200 / 2e3)
    assert s["nccl_ms"] == {"AllGather": pytest.approx(700 / 2e3)}
    # --steps overrides the annotation count.
    assert trace_summary.summarize(tmp_path / "t.json.gz", 4)["span_ms"] == pytest.approx(0.25)
    text = trace_summary.report([s, s], ["a", "b"], top=3)
    assert "compute idle (ms)" in text and "top kernels, b" in text


def test_trace_without_gpu_kernels_is_refused(tmp_path):
    path = write(tmp_path / "cpu.json.gz", [{"ph": "X", "cat": "cpu_op", "name": "aten::mm",
                                             "ts": 0, "dur": 5}])
    with pytest.raises(SystemExit, match="no GPU kernels"):
        trace_summary.summarize(path)
