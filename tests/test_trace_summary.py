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


def host(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def launched(name, ts, dur, correlation):
    event = kernel(name, ts, dur)
    event["args"]["correlation"] = correlation
    return event


def test_idle_is_charged_to_the_host_ops_that_launched_the_next_kernel(tmp_path):
    events = [
        # A host sync from 90 to 95 us (the host's clock a few us behind the device's): the
        # device runs dry at 100 and waits until 400.
        host("cpu_op", "aten::tolist", 80, 315),
        host("cuda_runtime", "cudaStreamSynchronize", 90, 5),
        # an earlier sync, long over when the device ran dry
        host("cuda_runtime", "cudaStreamSynchronize", 10, 20),
        host("cpu_op", "dtrain::accumulate_grouped_matmul", 395, 20),
        host("cpu_op", "aten::addmm", 396, 10),
        host("cuda_runtime", "cudaLaunchKernel", 398, 5, correlation=2),
        # A slow host op without a sync: 60 us idle, launched from another op.
        host("cpu_op", "aten::topk", 470, 90),
        host("cuda_runtime", "cudaLaunchKernel", 555, 4, correlation=3),
        # A short gap (20 us) is the launch queue's, not charged.
        host("cuda_runtime", "cudaLaunchKernel", 590, 4, correlation=4),
        launched("nvjet_gemm_a", 0, 100, 1),
        launched("nvjet_gemm_b", 400, 100, 2),
        launched("triton_poi_fused_topk", 560, 20, 3),
        launched("triton_poi_fused_after", 600, 50, 4),
        kernel("ncclDevKernel_AllGather", 100, 300),      # communication does not fill the gap
    ]
    s = trace_summary.summarize(write(tmp_path / "t.json.gz", events))
    sources = s["gap_sources"]
    assert set(sources) == {"aten::addmm < dtrain::accumulate_grouped_matmul", "aten::topk"}
    assert sources["aten::addmm < dtrain::accumulate_grouped_matmul"] == pytest.approx(
        (1, 0.3, 1))
    assert sources["aten::topk"] == pytest.approx((1, 0.06, 0))
    text = trace_summary.report([s], ["run"], top=2, sources=5)
    lines = text.split("idle over 50 us")[1].splitlines()
    assert "0.30 ms" in lines[1] and "sync x1" in lines[1] and "accumulate_grouped" in lines[1]
    assert "0.06 ms" in lines[2] and "sync x0" in lines[2] and "aten::topk" in lines[2]
