"""Weights in fewer bytes (fd/engine/model/qgemm.py): the kernels against numpy, the model in each
format against its own full recompute and against float32, and the fallback where the kernels
cannot run. (In tests/integration: the kernels are compiled by a g++ subprocess on first use.)

The kernels need AVX512-VNNI (int8) and AVX512-BF16 (bfloat16); on a CPU without them these
tests fail rather than skip, naming what is missing: this project's CI machines have both."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import paddle
import pytest

from fd.engine.model import llama, native, qgemm
from fd.engine.model.loader import load_model
from fd.engine.runner.model_runner import ModelRunner
from tests.kit.model import (  # noqa: F401  (tiny_dir: a fixture)
    BLOCK,
    Blocks,
    cut_at_the_second_layer,
    greedy_reference,
    random_prompt,
    run_batched,
    tiny_dir,
)

FORMATS = ("int8", "bfloat16")


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _int8_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """What the int8 format computes, in numpy: W's blocks of 32 along K with an fp16 scale,
    X's blocks quantized the same way (an fp32 scale), integer dots scaled back."""
    k, n = w.shape
    wb = w.reshape(k // 32, 32, n)
    dw = _f16(np.abs(wb).max(axis=1) / np.float32(127))  # [KB, N]
    with np.errstate(divide="ignore"):
        iw = np.where(dw > 0, np.float32(1) / dw, np.float32(0))
    wq = np.clip(np.rint(wb * iw[:, None, :]), -127, 127)
    xb = x.reshape(x.shape[0], k // 32, 32)
    dx = (np.abs(xb).max(axis=2) / np.float32(127)).astype(np.float32)  # [M, KB]
    with np.errstate(divide="ignore"):
        ix = np.where(dx > 0, np.float32(1) / dx, np.float32(0)).astype(np.float32)
    xq = np.rint(xb * ix[:, :, None])
    dots = np.einsum("mbk,bkn->mbn", xq.astype(np.float64), wq.astype(np.float64))  # exact integers
    return np.einsum("mbn,mb,bn->mn", dots, dx.astype(np.float64), dw.astype(np.float64))


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 rounded to bfloat16 (nearest, ties to even), as float64."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_kernels_are_here(fmt):
    assert qgemm.unavailable(fmt) is None, qgemm.unavailable(fmt)


#: each format's builds: AVX-512 here, and the integer formats' AVX2 one (which this CPU runs
#: too), so both are held to the same numpy emulation
BUILDS = [(f, b) for f in FORMATS for b in qgemm.FORMATS[f][1]]


@pytest.mark.parametrize("fmt,build", BUILDS)
@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (128, 512)])
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 70])
def test_a_kernel_computes_its_format_and_stays_within_its_error(fmt, build, shape, rows):
    rng = np.random.default_rng(rows * 7 + shape[0])
    w = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    w[:32, 0] = 0.0  # an all-zero block: scale 0, no division by it
    x = rng.standard_normal((rows, shape[0])).astype(np.float32)
    got = qgemm.QuantLinear(w, fmt, threads=2, build=build)(paddle.to_tensor(x)).numpy()
    exact = x.astype(np.float64) @ w.astype(np.float64)
    if fmt == "int8":
        emulated = _int8_reference(x, w)
        bound = 1.5e-2  # 8-bit weights and activations: ~0.4% each per value, ~0.8% a dot
    else:
        emulated = _bf16(x) @ _bf16(w)
        bound = 5e-3  # bfloat16's 8-bit mantissa on both sides
    # the format itself, to float32 rounding of the sums
    np.testing.assert_allclose(got, emulated, rtol=2e-5, atol=2e-5 * float(np.abs(emulated).max()))
    err = float(np.linalg.norm(got - exact) / np.linalg.norm(exact))
    assert err < bound, (fmt, err)


@pytest.mark.parametrize("fmt,build", BUILDS)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_the_down_projection_takes_swiglu_of_gate_and_up_as_they_lie(fmt, build, rows):
    """``swiglu(x)``: silu(gate) * up of x = [gate | up] fed to the GEMM, the same as the
    activation computed first (float32 rounding of the exponential apart)."""
    rng = np.random.default_rng(rows)
    k, n = 1536, 576
    lin = qgemm.QuantLinear(
        (rng.standard_normal((k, n)) * 0.02).astype(np.float32), fmt, threads=2, build=build
    )
    x = (rng.standard_normal((rows, 2 * k)) * 3).astype(np.float32)
    x[0, :4] = [-100.0, 100.0, -1e30, 0.0]  # (silu's tails: e^x out of range either way)
    gate, up = x[:, :k].astype(np.float64), x[:, k:].astype(np.float64)
    act = (gate / (1 + np.exp(-np.clip(gate, -700, 700))) * up).astype(np.float32)
    want = lin(paddle.to_tensor(act)).numpy()
    got = lin.swiglu(paddle.to_tensor(x)).numpy()
    assert np.isfinite(got).all()
    # (an activation one float32 rounding off may round to the next 8-bit step: a step's worth)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * float(np.abs(want).max()))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


def _q4_blocks(w: np.ndarray) -> np.ndarray:
    """``w`` [K, N] as GGUF's Q4_1 holds it (what fd's GGUF reader dequantizes): per block of 32
    along K, ``d * q + m`` with q in 0..15, d and m fp16."""
    k, n = w.shape
    b = w.reshape(k // 32, 32, n)
    lo, hi = b.min(axis=1), b.max(axis=1)
    d, m = _f16((hi - lo) / 15), _f16(lo)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.clip(np.rint(np.where(d[:, None] > 0, (b - m[:, None]) / d[:, None], 0)), 0, 15)
    return (d[:, None] * q + m[:, None]).reshape(k, n).astype(np.float32)


def _q4_0_blocks(w: np.ndarray) -> np.ndarray:
    """``w`` [K, N] as GGUF's Q4_0 holds it: per block of 32, ``d * (q - 8)``, q in 0..15, d fp16
    from the value of the largest magnitude (as -8 d)."""
    k, n = w.shape
    b = w.reshape(k // 32, 32, n)
    big = np.take_along_axis(b, np.abs(b).argmax(axis=1)[:, None, :], axis=1)[:, 0]
    d = _f16(big / -8)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.clip(np.rint(np.where(d[:, None] != 0, b / d[:, None], 0)) + 8, 0, 15)
    return (d[:, None] * (q - 8)).reshape(k, n).astype(np.float32)


@pytest.mark.parametrize("build", list(qgemm.FORMATS["int4"][1]))
@pytest.mark.parametrize("shape", [(576, 960), (1536, 576)])
@pytest.mark.parametrize("rows", [1, 4, 9, 70])
@pytest.mark.parametrize("blocks", [_q4_blocks, _q4_0_blocks])
def test_int4_computes_a_ggufs_own_blocks_with_8_bit_activations(build, shape, rows, blocks):
    rng = np.random.default_rng(rows + shape[1])
    w = blocks((rng.standard_normal(shape) * 0.02).astype(np.float32))
    w[:32, 0] = 0.25  # (a constant block: step 0)
    x = rng.standard_normal((rows, shape[0])).astype(np.float32)
    got = qgemm.QuantLinear(w, "int4", threads=2, build=build)(paddle.to_tensor(x)).numpy()
    # the weights exactly, the activations as int8 quantizes them (scale per block of 32)
    k = shape[0]
    xb = x.reshape(rows, k // 32, 32)
    dx = xb.__abs__().max(axis=2) / np.float32(127)
    with np.errstate(divide="ignore"):
        xq = np.rint(xb * np.where(dx > 0, np.float32(1) / dx, 0)[:, :, None])
    emulated = (xq * dx[:, :, None]).reshape(rows, k).astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(got, emulated, rtol=2e-5, atol=2e-5 * float(np.abs(emulated).max()))
    exact = x.astype(np.float64) @ w.astype(np.float64)
    assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 1e-2  # (the activations' 8 bits)


def test_int4_takes_only_weights_that_are_4_bit_blocks(tiny_dir, tmp_path, caplog):  # noqa: F811
    """A weight off a 16-step grid is refused (NotExact); a model asked for int4 holds those in
    int8 and says which, and the rest in int4, whose tokens equal its own full recompute."""
    rng = np.random.default_rng(5)
    with pytest.raises(qgemm.NotExact):
        qgemm.QuantLinear(rng.standard_normal((64, 32)).astype(np.float32), "int4")
    from safetensors.numpy import load_file, save_file

    d = tmp_path / "q4"
    import shutil

    shutil.copytree(tiny_dir, d)
    weights = load_file(str(d / "model.safetensors"))
    dense = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for name, a in weights.items():
        if any(p in name for p in dense):  # [out, in]: blocks along in, as GGUF's
            weights[name] = _q4_blocks(a.T.copy()).T.copy()
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="fd.engine"):
        runner = ModelRunner(str(d), num_blocks=64, block_size=BLOCK, weight_format="int4")
    model = runner.model
    assert model.weight_format == "int4"
    for layer in model.layers:
        assert {layer[n + "_q"].fmt for n in ("o", "gate_up", "down")} == {"int4"}
        # (q|k|v: q carries the softmax scale, 1/sqrt(32) here, which takes its steps off fp16;
        # SmolLM2's 1/8 keeps them on it)
        assert layer["qkv_q"].fmt == "int8"
    assert model.lm_head_q is not None and model.lm_head_q.fmt == "int8"  # (the head: random floats)
    said = [r.getMessage() for r in caplog.records if "held in int8" in r.getMessage()]
    assert said == ["weights not in 4-bit blocks, held in int8: the head, layer 0's q|k|v, layer 1's q|k|v"]
    prompts = {f"r{i}": random_prompt(200 + i, 20 + 7 * i) for i in range(3)}
    got, _ = run_batched(runner, prompts, 10, {"r2": 9}, Blocks(64, 1))
    for r, p in prompts.items():
        assert got[r] == greedy_reference(model, p, 10), r
    fp32 = load_model(str(d), progress=False)
    ids = random_prompt(7, 40)
    a, b = fp32.reference_logits(ids), model.reference_logits(ids)
    assert np.linalg.norm(b - a) / np.linalg.norm(a) < 0.05


@pytest.mark.parametrize("fmt,build", BUILDS)
@pytest.mark.parametrize("rows", [1, 6])
def test_a_gemm_takes_its_rms_norm_and_the_residual_add_on_the_way_in(fmt, build, rows):
    """``normed(x, r, w, eps)``: the residual sum x + r exactly, and the GEMM of its RMSNorm, as
    the model's norm op and the GEMM give them apart (float32 rounding of the norm apart)."""
    from fd.engine.model.llama import composed_rms_norm

    rng = np.random.default_rng(rows + len(build))
    k, n = 576, 960
    lin = qgemm.QuantLinear(
        (rng.standard_normal((k, n)) * 0.02).astype(np.float32), fmt, threads=2, build=build
    )
    x, r = (paddle.to_tensor((rng.standard_normal((rows, k)) * 2).astype(np.float32)) for _ in range(2))
    w = paddle.to_tensor((1 + rng.standard_normal(k) * 0.1).astype(np.float32))
    for residual in (r, None):
        y, s = lin.normed(x, residual, w, 1e-5)
        h, want_s = composed_rms_norm(x, w, 1e-5, residual)
        np.testing.assert_array_equal(s.numpy(), want_s.numpy())
        want = lin(h).numpy()
        np.testing.assert_allclose(y.numpy(), want, rtol=0, atol=2e-2 * float(np.abs(want).max()))
        assert np.linalg.norm(y.numpy() - want) / np.linalg.norm(want) < 2e-3


def test_a_layer_that_reuses_writes_its_next_output_of_as_many_rows_into_the_last_ones_tensor():
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((64, 32)) * 0.1).astype(np.float32)
    x1, x2 = (paddle.to_tensor(rng.standard_normal((3, 64)).astype(np.float32)) for _ in range(2))
    fresh = qgemm.QuantLinear(w, "int8")
    reusing = qgemm.QuantLinear(w, "int8", reuse=True)
    a = reusing(x1)
    first = a.numpy().copy()
    np.testing.assert_array_equal(first, fresh(x1).numpy())
    b = reusing(x2)
    assert b.data_ptr() == a.data_ptr()  # (the same memory: the first output is overwritten)
    np.testing.assert_array_equal(b.numpy(), fresh(x2).numpy())
    assert reusing(x1[:2]).data_ptr() != a.data_ptr()  # (other rows: another tensor)
    assert reusing(x1[:2]).data_ptr() == reusing(x2[:2]).data_ptr()  # (which the next takes)
    for layer, rows in ((fresh, 3), (reusing, qgemm.REUSE_ROWS + 1)):  # (outputs that stay)
        big = [paddle.to_tensor(rng.standard_normal((rows, 64)).astype(np.float32)) for _ in range(2)]
        y = layer(big[0])
        kept = y.numpy().copy()
        layer(big[1])
        np.testing.assert_array_equal(y.numpy(), kept)


def test_a_weight_of_a_shape_the_kernels_do_not_take_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        qgemm.QuantLinear(np.zeros((40, 16), np.float32), "int8")
    with pytest.raises(ValueError, match="float32"):
        qgemm.QuantLinear(np.zeros((32, 16), np.float32), "int8")(paddle.zeros([2, 32], dtype="float64"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_quantized_model_holds_no_float32_copy_and_its_paged_batches_equal_its_recompute(tiny_dir, fmt):
    """Every dense weight in the format (none left in float32), and the paged, chunked, batched
    path gives the same greedy tokens as the model's own full recompute: the kernels compute
    each row alone, so a row's result does not depend on its batch."""
    runner = ModelRunner(tiny_dir, num_blocks=64, block_size=BLOCK, weight_format=fmt)
    model = runner.model
    assert model.weight_format == fmt
    assert model.lm_head is None and model.lm_head_q is not None
    for layer in model.layers:
        for n in ("qkv", "o", "gate_up", "down"):
            assert layer[n] is None and layer[n + "_q"].fmt == fmt
    prompts = {f"r{i}": random_prompt(100 + i, 20 + 7 * i) for i in range(3)}
    got, _ = run_batched(runner, prompts, 12, {"r2": 9}, Blocks(64, 1))
    for r, p in prompts.items():
        assert got[r] == greedy_reference(model, p, 12), r


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_quantized_models_logits_stay_near_float32s(tiny_dir, fmt):
    fp32 = load_model(tiny_dir, progress=False)
    q = load_model(tiny_dir, progress=False, weight_format=fmt)
    ids = random_prompt(7, 40)
    a, b = fp32.reference_logits(ids), q.reference_logits(ids)
    err = float(np.linalg.norm(b - a) / np.linalg.norm(a))
    assert err < (0.05 if fmt == "int8" else 0.02), err


#: the tiny model's greedy tokens in each format (recorded on AMD EPYC Zen 4; the kernels compute
#: the same on any CPU that runs them: same instructions, same order). float32's are the
#: reference the others are read against.
RECORDED: dict[str, list[list[int]]] = {
    "float32": [
        [374, 153, 390, 52, 244, 115, 329, 153, 196, 234],
        [139, 22, 94, 185, 64, 480, 44, 91, 175, 35],
        [113, 464, 228, 428, 17, 305, 359, 396, 41, 510],
    ],
    "int8": [
        [374, 153, 390, 52, 244, 115, 329, 153, 196, 234],
        [139, 22, 94, 185, 64, 480, 44, 91, 175, 35],
        [113, 283, 112, 144, 78, 257, 110, 233, 5, 121],  # (parts from float32 at its 2nd token)
    ],
    "bfloat16": [
        [374, 153, 390, 52, 244, 115, 329, 153, 196, 234],
        [139, 22, 94, 185, 64, 480, 44, 91, 175, 35],
        [113, 464, 228, 428, 17, 305, 359, 396, 41, 510],
    ],
}


@pytest.mark.parametrize("fmt", ("float32", *FORMATS))
def test_a_formats_greedy_tokens_equal_its_recorded_ones(tiny_dir, fmt):
    model = load_model(tiny_dir, progress=False, weight_format=fmt)
    got = [greedy_reference(model, random_prompt(s, 16), 10) for s in (1, 2, 3)]
    assert got == RECORDED[fmt]


@contextmanager
def isa_ceiling(value: str) -> Iterator[None]:
    """``FD_MAX_CPU_ISA=value`` for the block; the caches that read it cleared on both sides."""

    def clear() -> None:
        native.cpu_flags.cache_clear()
        qgemm._library.cache_clear()

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FD_MAX_CPU_ISA", value)
        clear()
        try:
            yield
        finally:
            mp.undo()
            clear()


@pytest.mark.parametrize("fmt", ("int8", "int4"))
def test_a_cpu_with_avx2_alone_runs_the_integer_formats_avx2_kernels_to_the_same_logits(tiny_dir, fmt):  # noqa: F811
    """What an AVX2 CPU (no AVX-512) gets: the same formats by their own build, whose integer
    sums are the same, so its logits are the AVX-512 build's on the same (composed) RMSNorm.
    (Against the fused norm they differ by up to ~0.2: its last-bit differences move some
    activations across an 8-bit rounding step.)"""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(paddle.base.core, "supports_avx512f", lambda: False)
        vnni = load_model(tiny_dir, progress=False, weight_format=fmt)
    with isa_ceiling("avx2"):
        assert qgemm.isa(fmt) == "avx2" and not llama.fused_rms_norm_runs("cpu")
        avx2 = load_model(tiny_dir, progress=False, weight_format=fmt)
    assert avx2.weight_format == fmt and avx2._rms_norm is llama.composed_rms_norm
    ids = random_prompt(11, 30)
    np.testing.assert_allclose(avx2.reference_logits(ids), vnni.reference_logits(ids), rtol=0, atol=1e-5)


def test_bfloat16_weights_on_a_cpu_without_avx512_bf16_are_float32_and_one_line_says_why(tiny_dir, caplog):  # noqa: F811
    with isa_ceiling("avx2"), caplog.at_level(logging.WARNING, logger="fd.engine"):
        model = load_model(tiny_dir, progress=False, weight_format="bfloat16")
    assert model.weight_format == "float32"
    said = [r.getMessage() for r in caplog.records if "bfloat16" in r.getMessage()]
    assert said == [
        "weights in float32, not bfloat16: its kernels cannot run here (this CPU lacks "
        "avx512f, avx512bw, avx512vl, avx512dq, avx512_bf16)"
    ]


def test_an_unknown_isa_ceiling_is_named_and_ignored(caplog):
    with isa_ceiling("sse9"), caplog.at_level(logging.WARNING, logger="fd.engine"):
        flags = native.cpu_flags()
    assert "avx2" in flags
    assert [r.getMessage() for r in caplog.records] == [
        "FD_MAX_CPU_ISA=sse9 ignored: it takes avx2 or avx512"
    ]


def test_int8_on_a_gpu_is_paddles_weight_only_gemm_where_one_runs_and_agrees():
    """The GPU route itself is untested here (no GPU): what is tested is that it is refused, with
    the reason, where it cannot run, so the model keeps float32 rather than failing."""
    from fd.engine.model import weight_only

    assert "CPU" in (weight_only.unavailable("cpu") or "")
    if not paddle.is_compiled_with_cuda():
        assert weight_only.unavailable("gpu") == "this Paddle build has no CUDA"
        assert weight_only.unavailable("gpu:1") == "this Paddle build has no CUDA"


def test_where_the_kernels_cannot_run_the_model_keeps_float32_and_says_why(tiny_dir, monkeypatch, caplog):
    monkeypatch.setattr(qgemm, "_library", lambda fmt: "this CPU lacks avx512_vnni")
    with caplog.at_level(logging.WARNING, logger="fd.engine"):
        model = load_model(tiny_dir, progress=False, weight_format="int8")
    assert model.weight_format == "float32" and model.lm_head is not None and model.lm_head_q is None
    assert any(
        "float32, not int8" in r.getMessage() and "avx512_vnni" in r.getMessage() for r in caplog.records
    )
    fp32 = load_model(tiny_dir, progress=False)
    ids = random_prompt(3, 12)
    np.testing.assert_array_equal(model.reference_logits(ids), fp32.reference_logits(ids))


def _counting_kernel_layers(model) -> list[int]:
    """Count the steps fd/engine/model/kernel_layers.py takes."""
    taken: list[int] = []
    run = model.kernel_layers.run

    def counted(x0, *args):
        taken.append(int(x0.shape[0]))
        return run(x0, *args)

    model.kernel_layers.run = counted
    return taken


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_layers_as_the_kernels_calls_alone_give_the_per_call_paths_bits(tiny_dir, fmt):
    """fd/engine/model/kernel_layers.py: every layer as its six kernel calls, laid out once per
    step size, gives the per-call path's greedy tokens and logits bit for bit: decodes of
    several sizes, and short prefill chunks beside them (a step it does not take, of two
    attention groups, goes the per-call way)."""
    runner = ModelRunner(tiny_dir, num_blocks=400, block_size=BLOCK, weight_format=fmt)
    model = runner.model
    assert model.kernel_layers is not None
    taken = _counting_kernel_layers(model)
    prompts = {f"r{i}": random_prompt(200 + i, 20 + 7 * i) for i in range(9)}
    chunks = {"r0": 9, "r4": 16}
    got, got_logits = run_batched(runner, prompts, 8, chunks, Blocks(400, seed=3))
    # (sizes as the requests end: a size laid out again after others)
    prompts.update({f"s{i}": random_prompt(300 + i, 12) for i in range(3)})
    more, more_logits = run_batched(
        runner, {k: prompts[k] for k in ("s0", "s1", "s2")}, 4, {}, Blocks(400, 4)
    )
    assert len(set(taken)) >= 2, taken
    model.kernel_layers = None
    want, want_logits = run_batched(
        runner, {k: v for k, v in prompts.items() if k.startswith("r")}, 8, chunks, Blocks(400, seed=3)
    )
    want_more, want_more_logits = run_batched(
        runner, {k: prompts[k] for k in ("s0", "s1", "s2")}, 4, {}, Blocks(400, 4)
    )
    assert got == want and more == want_more
    for got_l, want_l in ((got_logits, want_logits), (more_logits, want_more_logits)):
        for r in got_l:
            np.testing.assert_array_equal(np.stack(got_l[r]), np.stack(want_l[r]), err_msg=r)


def test_an_abort_cut_between_the_kernel_layers_writes_none_of_its_kv_after(tiny_dir):
    """fd/engine/runner/step_cut.py through fd/engine/model/kernel_layers.py: a request cut as
    the first layer runs keeps that layer's KV only, and the other request of the batch gets
    the token it gets uncut."""
    from fd.control.sampling import SamplingParams
    from fd.engine.core.outputs import ScheduledSeq, SchedulerOutput
    from fd.engine.runner.step_cut import StepCut

    runner = ModelRunner(tiny_dir, num_blocks=64, block_size=BLOCK, weight_format="int8")
    model = runner.model
    taken = _counting_kernel_layers(model)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)

    def step(n: int) -> SchedulerOutput:
        a = ScheduledSeq("a", (7,), 20, (10, 11), True, greedy, 1)
        b = ScheduledSeq("b", (9,), 20, (20, 21), True, greedy, 1)
        return SchedulerOutput(step=n, seqs=(a, b), num_batched_tokens=2)

    def k_at(block: int, pos: int) -> np.ndarray:  # each layer's K of one slot, every KV head
        slot = block * BLOCK + pos
        kvh = model.cfg.num_key_value_heads
        return np.stack(
            [np.stack([k.numpy()[h * model.num_slots + slot] for h in range(kvh)]) for k in model.k_slots]
        )

    alone = runner.execute(step(1))
    for k in (*model.k_blocks, *model.v_blocks):
        k[:, 11] = 0.0
    sent: list = []
    cut = StepCut(sent.append)
    out = step(2)
    cut.begin(out)
    cut_at_the_second_layer(cut, out.step, frozenset({"a"}))
    res = runner.execute(out, cut)
    cut.end()
    assert taken == [2, 2]
    assert [tuple(s) for s in sent] == [(2, ["a"])]
    assert set(res.sampled) == {"b"} and res.sampled["b"] == alone.sampled["b"]
    ka = k_at(11, 20 - BLOCK)
    assert np.abs(ka[0]).min() > 0  # the first layer wrote a's key
    assert not ka[1:].any()  # no later layer did
    assert np.abs(k_at(21, 20 - BLOCK)).min() > 0  # b's, every layer
