"""RMSNorm: Paddle's fused kernel where it runs, the composed ops elsewhere, the same numbers."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fd.engine.model import llama
from fd.engine.model.loader import load_model


def _reference(x: np.ndarray, w: np.ndarray, eps: float, residual: np.ndarray | None):
    s = x if residual is None else x + residual
    h = s / np.sqrt(np.mean(s.astype(np.float64) ** 2, axis=-1, keepdims=True) + eps) * w
    return h, s


NORMS = [llama.composed_rms_norm]
if llama.fused_rms_norm_runs("cpu"):
    NORMS.append(llama.fused_rms_norm)


@pytest.mark.parametrize("norm", NORMS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_numpy(norm, with_residual):
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((7, 96)).astype(np.float32), rng.standard_normal(96).astype(np.float32)
    r = rng.standard_normal((7, 96)).astype(np.float32) if with_residual else None
    h, s = norm(paddle.to_tensor(x), paddle.to_tensor(w), 1e-5, None if r is None else paddle.to_tensor(r))
    want_h, want_s = _reference(x, w, 1e-5, r)
    np.testing.assert_allclose(h.numpy(), want_h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s.numpy(), want_s, rtol=1e-6, atol=1e-6)


def test_a_cpu_without_avx512_runs_the_model_on_the_composed_norm(tiny_model_dir, monkeypatch):
    """Paddle's fused CPU kernel is AVX-512 only (SIGILL elsewhere): a CPU without it gets the
    composed ops, and the same logits as the fused kernel where that runs."""
    d = str(tiny_model_dir)
    prompt = list(range(5, 25))
    here = load_model(d, progress=False).reference_logits(prompt)
    monkeypatch.setattr(paddle.base.core, "supports_avx512f", lambda: False)
    assert not llama.fused_rms_norm_runs("cpu") and llama.fused_rms_norm_runs("gpu:0")
    plain = load_model(d, progress=False)
    assert plain._rms_norm is llama.composed_rms_norm
    np.testing.assert_allclose(plain.reference_logits(prompt), here, atol=1e-4)
