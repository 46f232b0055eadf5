"""bench/bf16_agreement.py's rounding: float32 to the nearest bfloat16, as Paddle's cast rounds."""

from __future__ import annotations

import numpy as np
import paddle

from bench.bf16_agreement import round_bf16


def test_round_bf16_is_paddles_cast_to_bfloat16_and_back():
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [rng.standard_normal(10_000), rng.standard_normal(1000) * 1e-30, rng.standard_normal(1000) * 1e30]
    ).astype(np.float32)
    want = paddle.cast(paddle.cast(paddle.to_tensor(x), "bfloat16"), "float32").numpy()
    np.testing.assert_array_equal(round_bf16(x), want)


def test_round_bf16_rounds_ties_to_even_and_keeps_what_bf16_holds():
    one = np.float32(1.0)
    ulp = np.float32(2.0**-7)  # bf16's step just above 1
    x = np.array([one + ulp / 2, one + ulp * 1.5, one + ulp / 2 + 2.0**-20, 3.0, -2.5], dtype=np.float32)
    np.testing.assert_array_equal(round_bf16(x), [one, one + 2 * ulp, one + ulp, 3.0, -2.5])
