"""The FP8 GEMM that adds into its fp32 output (``dtrain.kernels.cublaslt``): its arithmetic,
its checks, what it does with operands cuBLASLt does not take or when cuBLASLt fails, its use
inside compiled graphs, from two threads and on two streams, and (on a GPU with FP8) cuBLASLt's
result.

Operands are small integers unless said otherwise: their products and sums are exact in fp32,
whichever path computes them, so results are compared for equality."""

import re
import threading

import pytest
import torch

from dtrain.kernels import cublaslt, cublaslt_binding
from dtrain.kernels.cublaslt import accumulate_scaled_mm

FP8_GPU = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a GPU with FP8 (cuBLASLt's FP8 GEMM); its output is in docs/benchmarks.md")
DEVICES = ["cpu", pytest.param("cuda", marks=FP8_GPU)]


def small_integers(shape, dtype, device, seed):
    """FP8 values that are small integers: their products and sums are exact in fp32."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=generator).float().to(dtype).to(device)


def operands(device, m=96, n=80, k=128, scales=(0.5, 4.0), seed=0):
    a = small_integers((m, k), torch.float8_e5m2, device, seed)  # row-major
    b = small_integers((n, k), torch.float8_e4m3fn, device, seed + 1).t()  # column-major
    total = small_integers((m, n), torch.float32, device, seed + 2) * 8
    return total, a, b, tuple(torch.tensor(s, device=device) for s in scales)


def product(a, b, scales):
    return (a.double().cpu() * scales[0].item()) @ (b.double().cpu() * scales[1].item())


def exact(total, a, b, scales):
    return total.double().cpu() + product(a, b, scales)


def misaligned(x):
    """A copy of ``x`` (same strides) whose storage starts one element past an allocation, so
    its address is not a multiple of 16 bytes."""
    storage = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:]
    return storage.as_strided(x.shape, x.stride()).copy_(x)


@pytest.fixture
def warnings(monkeypatch):
    """The warnings logged during the test, each fallback reason said afresh."""
    said = []
    monkeypatch.setattr(cublaslt.logger, "warning",
                        lambda message, *args: said.append(message % args))
    cublaslt.warn_fallback.cache_clear()
    yield said
    cublaslt.warn_fallback.cache_clear()


@pytest.mark.parametrize("device", DEVICES)
def test_the_product_is_added_into_total_in_place(device, warnings):
    total, a, b, scales = operands(device)
    expected, storage = exact(total, a, b, scales), total.data_ptr()
    accumulate_scaled_mm(total, a, b, *scales)
    assert total.data_ptr() == storage
    assert torch.equal(total.double().cpu(), expected)
    assert warnings == []


@pytest.mark.parametrize("device", DEVICES)
def test_inside_a_compiled_graph_the_add_reaches_the_input(device):
    total, a, b, scales = operands(device)
    expected = exact(total, a, b, scales)

    @torch.compile(fullgraph=True)
    def step(total, a, b, inverse_scale_a, inverse_scale_b):
        accumulate_scaled_mm(total, a, b, inverse_scale_a, inverse_scale_b)

    step(total, a, b, *scales)
    assert torch.equal(total.double().cpu(), expected)


@FP8_GPU
@pytest.mark.parametrize("fast_accum", [False, True])
def test_cublaslt_s_sum_is_scaled_mm_s_fp32_product_added(fast_accum):
    """Random operands at a weight gradient's shape: the GEMM's own add in fp32 gives what
    ``_scaled_mm``'s fp32 product added afterwards gives (measured bit for bit on an H200)."""
    torch.manual_seed(0)
    a = (torch.randn(1024, 4096, device="cuda") * 8).to(torch.float8_e5m2)
    b = torch.randn(2048, 4096, device="cuda").to(torch.float8_e4m3fn).t()
    scales = torch.tensor(0.25, device="cuda"), torch.tensor(0.5, device="cuda")
    total = torch.randn(1024, 2048, device="cuda")
    product = torch._scaled_mm(a, b, *scales, out_dtype=torch.float32, use_fast_accum=fast_accum)
    expected = total + product
    accumulate_scaled_mm(total, a, b, *scales, fast_accum=fast_accum)
    # one fp32 rounding of the same sum either way; the tolerance (about 8 ulp of fp32) leaves room
    # for cuBLASLt's heuristic choosing another tiling or split of K for the beta-1 problem
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=1e-6 * product.abs().max())


@pytest.mark.parametrize("bad,message", [
    ("a_column_major", "a must be row-major and b column-major"),
    ("total_bf16", "total must be a contiguous fp32 [96, 80]"),
    ("both_e5m2", "a and b must be FP8, not both e5m2"),
    ("k", "a is [96, 128] but b is [64, 80]"),
    ("scale_vector", "the scales must be fp32 scalars"),
    ("a_batched", "a and b must be matrices, got (1, 96, 128) and (128, 80)"),
])
def test_wrong_operands_are_named(bad, message):
    total, a, b, scales = operands("cpu")
    if bad == "a_column_major":
        a = a.t().contiguous().t()
    elif bad == "total_bf16":
        total = total.to(torch.bfloat16)
    elif bad == "both_e5m2":
        b = b.to(torch.float32).to(torch.float8_e5m2)
    elif bad == "scale_vector":
        scales = (torch.tensor([0.5, 0.5]), scales[1])
    elif bad == "a_batched":
        a = a.unsqueeze(0)
    else:
        b = b[:64]
    with pytest.raises(ValueError, match=r"^accumulate_scaled_mm: .*" + re.escape(message)):
        accumulate_scaled_mm(total, a, b, *scales)


@FP8_GPU
def test_a_scale_on_another_device_is_named():
    """cuBLASLt reads the scales through device pointers: a CPU scale is refused up front."""
    total, a, b, scales = operands("cuda")
    with pytest.raises(ValueError, match=r"all must be on one device, got \['cpu', 'cuda:0'\]"):
        accumulate_scaled_mm(total, a, b, scales[0].cpu(), scales[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case,reason", [
    ("total_misaligned", "total's address is not a multiple of 16 bytes"),
    ("a_misaligned", "a's address is not a multiple of 16 bytes"),
    ("b_misaligned", "b's address is not a multiple of 16 bytes"),
    ("k_8", "a's leading dimension is not a multiple of 16 bytes"),  # 8 FP8 values a row
    ("n_6", "total's leading dimension is not a multiple of 16 bytes"),  # 6 floats a row
    ("n_20", "N is not a multiple of 16"),  # as torch._scaled_mm requires
])
def test_operands_cublaslt_does_not_take_are_added_by_torch_after_one_warning(
        device, case, reason, warnings):
    """Operands the contract allows but cuBLASLt's FP8 GEMM does not take (16-byte addresses
    and leading dimensions): the exact sum, computed by torch, and one warning naming why for
    two calls."""
    shape = {"k_8": {"k": 8}, "n_6": {"n": 6}, "n_20": {"n": 20}}.get(case, {})
    total, a, b, scales = operands(device, **shape)
    if case.endswith("misaligned"):
        named = {"total": total, "a": a, "b": b}
        named[case.split("_")[0]] = misaligned(named[case.split("_")[0]])
        total, a, b = named["total"], named["a"], named["b"]
    expected = total.double().cpu() + 2 * product(a, b, scales)
    accumulate_scaled_mm(total, a, b, *scales)
    accumulate_scaled_mm(total, a, b, *scales)
    assert torch.equal(total.double().cpu(), expected)
    assert len(warnings) == 1
    assert reason in warnings[0] and "second pass" in warnings[0]


@pytest.mark.parametrize("device", DEVICES)
def test_an_empty_product_leaves_total_as_it_is(device, warnings):
    total, a, b, scales = operands(device, k=0)
    before = total.clone()
    accumulate_scaled_mm(total, a, b, *scales)
    assert torch.equal(total, before)
    assert warnings == []


def test_the_gemm_works_on_cuda_devices_only():
    assert cublaslt.works(torch.device("cpu")) is False


@FP8_GPU
@pytest.mark.parametrize("m,n,k", [(1, 16, 16), (17, 48, 32), (40, 32, 16)])
def test_any_number_of_rows_is_cublaslt_s(m, n, k, warnings):
    """M is any (as for ``_scaled_mm``: a's rows are whole and 16-byte aligned whatever their
    number): the exact sum, from cuBLASLt, with no warning."""
    total, a, b, scales = operands("cuda", m, n, k)
    expected = exact(total, a, b, scales)
    accumulate_scaled_mm(total, a, b, *scales)
    assert torch.equal(total.double().cpu(), expected)
    assert warnings == []


@FP8_GPU
def test_a_cublaslt_failure_on_a_call_adds_torch_s_product_after_one_warning(monkeypatch,
                                                                              warnings):
    """cuBLASLt working when first checked and failing on a later call (here its library no
    longer loads): each call adds torch's product, after one warning that names the failure."""
    total, a, b, scales = operands("cuda")
    assert cublaslt.works(total.device)
    monkeypatch.setattr(cublaslt_binding, "library_path", lambda: "/nonexistent/libcublasLt.so.13")
    expected = total.double().cpu() + 2 * product(a, b, scales)
    accumulate_scaled_mm(total, a, b, *scales)
    accumulate_scaled_mm(total, a, b, *scales)
    assert torch.equal(total.double().cpu(), expected)
    assert len(warnings) == 1
    assert "/nonexistent/libcublasLt.so.13" in warnings[0] and "second pass" in warnings[0]


@FP8_GPU
def test_without_cublaslt_the_product_is_added_after_a_warning(monkeypatch, warnings):
    """cuBLASLt that does not load (here a path that is not there): one warning names it, and
    the sum is still right (``_scaled_mm``'s fp32 product added afterwards)."""
    monkeypatch.setattr(cublaslt_binding, "library_path", lambda: "/nonexistent/libcublasLt.so.13")
    cublaslt.works.cache_clear()
    try:
        total, a, b, scales = operands("cuda")
        expected = total.double().cpu() + 2 * product(a, b, scales)
        accumulate_scaled_mm(total, a, b, *scales)
        accumulate_scaled_mm(total, a, b, *scales)  # warned once, not per call
        assert torch.equal(total.double().cpu(), expected)
        assert len(warnings) == 1
        assert "does not work on cuda" in warnings[0] and "second pass" in warnings[0]
    finally:
        cublaslt.works.cache_clear()  # checked again, with the library, where next asked


CALLS = 50


@FP8_GPU
def test_two_threads_at_once_each_get_their_exact_sums():
    """Both threads' GEMMs share one cached descriptor, on which each call sets its own scales:
    the scales of one thread reaching the other's GEMM would change its sums."""
    jobs = [operands("cuda", seed=0, scales=(0.5, 4.0)),
            operands("cuda", seed=3, scales=(2.0, 0.25))]
    expected = [total.double().cpu() + CALLS * product(a, b, scales)
                for total, a, b, scales in jobs]
    start, errors = threading.Barrier(len(jobs)), []

    def accumulate(total, a, b, scales):
        try:
            start.wait()
            for _ in range(CALLS):
                accumulate_scaled_mm(total, a, b, *scales)
            torch.cuda.current_stream().synchronize()
        except Exception as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=accumulate, args=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    for (total, *_), want in zip(jobs, expected, strict=True):
        assert torch.equal(total.double().cpu(), want)


@FP8_GPU
def test_each_stream_has_its_own_workspace():
    """GEMMs running at once on two streams each write their own workspace, and each stream's
    sums are exact."""
    device = torch.device("cuda", torch.cuda.current_device())
    streams = torch.cuda.Stream(), torch.cuda.Stream()
    first, second = (cublaslt_binding.workspace(device, stream) for stream in streams)
    assert first is cublaslt_binding.workspace(device, streams[0])
    assert first is not second and first.data_ptr() != second.data_ptr()
    jobs = [operands("cuda", seed=0), operands("cuda", seed=3)]
    expected = [total.double().cpu() + CALLS * product(a, b, scales)
                for total, a, b, scales in jobs]
    for stream, (total, a, b, scales) in zip(streams, jobs, strict=True):
        stream.wait_stream(torch.cuda.current_stream())  # the operands were made there
        with torch.cuda.stream(stream):
            for _ in range(CALLS):
                accumulate_scaled_mm(total, a, b, *scales)
    torch.cuda.synchronize()
    for (total, *_), want in zip(jobs, expected, strict=True):
        assert torch.equal(total.double().cpu(), want)


@FP8_GPU
def test_each_candidate_algorithm_adds_the_exact_product():
    """``candidate_algorithms``, as the GEMM benchmark uses it: bf16 operands (one row-major, one
    a transposed view), ``total += a @ b`` in fp32 with each algorithm the heuristic lists."""
    a = small_integers((64, 32), torch.bfloat16, "cuda", 0)
    b = small_integers((48, 32), torch.bfloat16, "cuda", 1).t()
    start = small_integers((64, 48), torch.float32, "cuda", 2)
    total = start.clone()
    calls = cublaslt_binding.candidate_algorithms(total, a, b, beta=1.0, most=8)
    assert 1 <= len(calls) <= 8
    expected = start.double().cpu() + a.double().cpu() @ b.double().cpu()
    for call in calls:
        total.copy_(start)
        call()
        assert torch.equal(total.double().cpu(), expected)
