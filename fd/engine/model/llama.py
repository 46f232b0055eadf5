"""The Llama-family decoder (Llama, Qwen2, Qwen3) in PaddlePaddle, over a paged KV cache.

One forward runs a flattened mixed batch: prefill chunks and decode tokens side by side. Each
token's K/V is written to its cache slot (``block * block_size + offset``); attention gathers a
sequence's context back by its block table, causal within the chunk and full over the past
(on a CPU, where fd's kernels build, RoPE, the cache writes and the decodes' attention are two
C++ calls a layer that read the cache in place: fd/engine/model/cpu_attention.py).

Two things shape the code more than the math does:

- **Op count and GEMM size.** For a model this small a step costs what Paddle dispatch
  (~2 µs per op) and small GEMMs cost, so projections are fused (q|k|v in one matmul, gate|up
  in one), RoPE is a multiply-add against a precomputed table, the residual add rides in the
  fused RMSNorm, logits are computed only for the rows being sampled, and attention is one
  padded, masked batch per group of sequences rather than a loop per sequence.
- **Batch invariance** (opt-in: ``batch_invariant=True``, ``fd serve --batch-invariant``). A
  request's tokens then do not depend on what else is in the batch. The CPU GEMM rounds rows that do not fill a whole 8-row tile differently, and Q·Kᵀ rounds
  differently unless the key length is a multiple of 16, so the token rows are padded to a
  multiple of 8 and every key length to a multiple of 16 (padding is masked: exact zeros).
  With that, a sequence's logits agree to ~1e-6 alone, in any batch, chunked or not, and in
  :meth:`Llama.reference_logits`, and its greedy tokens are the same but at near-ties (what
  tests/unit/test_model.py checks; on this project's CPU machines: GPUs differ).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import numpy as np
import paddle
import paddle.incubate.nn.functional as IF
import paddle.nn.functional as F

from fd.engine.model import cpu_attention, kernel_layers, native, packed_gemm, qgemm, weight_only
from fd.engine.model.checkpoint_layout import LAYER_VECTORS, layer_arrays
from fd.engine.model.config import ModelConfig, rope_inv_freq
from fd.engine.model.dense import DenseWeights, pack_weights, thread_quantized
from fd.engine.model.forward_batch import AttnGroup, ForwardBatch

log = logging.getLogger("fd.engine")

ROW_ALIGN = 8  # the CPU GEMM rounds rows outside full 8-row tiles differently
KEY_ALIGN = 16  # key lengths padded to a multiple of this for the same reason
MASKED = -1e30  # finite, so fully padded query rows stay NaN-free


def cpu_swiglu(x: paddle.Tensor) -> paddle.Tensor:
    """F.swiglu (silu(gate) * up of x = [gate | up]) on a CPU, whose fused kernel takes 1.4x as
    long as these three ops (0.10 against 0.07 ms for 32 rows of SmolLM2's 1536)."""
    gate, up = paddle.split(x, 2, axis=-1)
    return paddle.multiply(F.silu(gate), up)


def fused_rms_norm_runs(device: str) -> bool:
    """Whether Paddle's fused RMSNorm can run here. Its CPU kernel is written in AVX-512 and
    is not guarded: on a CPU without it (AMD before Zen 4, many laptops) it dies of SIGILL."""
    return device != "cpu" or native.has_avx512f()


def composed_rms_norm(
    x: paddle.Tensor, w: paddle.Tensor, eps: float, residual: paddle.Tensor | None = None
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """What ``fused_rms_norm`` computes, in plain ops: ``(rms_norm(x + residual) * w, x + residual)``."""
    if residual is not None:
        x = paddle.add(x, residual)
    ms = paddle.mean(paddle.square(x), axis=-1, keepdim=True)
    return paddle.multiply(paddle.multiply(x, paddle.rsqrt(ms + eps)), w), x


def fused_rms_norm(
    x: paddle.Tensor, w: paddle.Tensor, eps: float, residual: paddle.Tensor | None = None
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Paddle's fused kernel, with composed_rms_norm's contract."""
    if residual is None:
        return IF.fused_rms_norm(x, w, None, eps, 1)[0], x
    return IF.fused_rms_norm(x, w, None, eps, 1, residual=residual)


def pad_keys(n: int) -> int:
    return max(KEY_ALIGN, -(-n // KEY_ALIGN) * KEY_ALIGN)


def attention_mask(qpos: np.ndarray, num_keys: int, window: int | None = None) -> np.ndarray:
    """Additive mask [*qpos.shape, num_keys]: key ``k`` is seen from position ``q`` when
    ``k <= q`` and, with a sliding window of ``W`` (Mistral's, Phi-3's), ``k > q - W``: the W
    positions up to and including its own, as transformers' and vLLM's windows count them."""
    k = np.arange(num_keys)
    q = qpos[..., None]
    seen = k <= q if window is None else (k <= q) & (k > q - window)
    return np.where(seen, 0.0, MASKED).astype(np.float32)


def key_blocks(context_len: int, block_size: int) -> int:
    """Blocks of keys to gather for a context: enough, and a multiple of KEY_ALIGN keys."""
    n = -(-max(context_len, 1) // block_size)
    while (n * block_size) % KEY_ALIGN:
        n += 1
    return n


class Llama:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: Mapping[str, np.ndarray],
        device: str = "cpu",
        batch_invariant: bool = False,
        gemms: str = "eager",
        weight_format: str = "float32",
    ):
        """``gemms``: ``eager`` (every GEMM a Paddle matmul), ``packed`` (on a CPU with MKL, the
        dense layers' and the head's over weights packed once: fd/engine/model/packed_gemm.py),
        or ``auto`` (whichever of the two is faster here, timed at load).

        ``weight_format``: what the dense layers' and the head's weights are held and computed
        in: ``float32``, or on a CPU with the kernels' instructions ``int8`` (blocks of 32 with
        a scale, activations quantized the same way) or ``bfloat16``
        (fd/engine/model/qgemm.py). Where the kernels cannot run, the model says why in one
        line and keeps float32; :attr:`weight_format` is what it runs."""
        self.cfg = cfg
        self.device = device
        # Opt-in (vLLM's VLLM_BATCH_INVARIANT): batch 1 then runs its GEMMs on 8 rows, which on
        # SmolLM2-135M costs what batch 8 costs (134 against 52 ms a decode step on one core).
        # Off, a request's logits depend on what else is in the batch by rounding (~1e-6).
        self.batch_invariant = batch_invariant
        self.row_align = ROW_ALIGN if batch_invariant else 1
        self.place = (
            paddle.CPUPlace()
            if device == "cpu"
            else paddle.CUDAPlace(int(device.split(":")[1]) if ":" in device else 0)
        )
        # Strided views make a later matmul copy element by element (1.5 ms for one [32, 112,
        # 2, 32] transpose on CPU); real transposes cost ~30 µs.
        paddle.set_flags({"FLAGS_use_stride_kernel": False})
        hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.group = nh // nkv
        scale = np.float32(1.0 / np.sqrt(hd))

        def t(a: np.ndarray) -> paddle.Tensor:
            return paddle.to_tensor(np.ascontiguousarray(a, dtype=np.float32), place=self.place)

        threads = len(os.sched_getaffinity(0))
        held = DenseWeights(weight_format, device, self.place, threads)
        self.weight_format, self.gpu_weight_only = held.fmt, held.gpu_weight_only
        dense = held.put

        self.embed = t(weights["model.embed_tokens.weight"])
        head = weights["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
        top: dict = {}
        dense(top, "lm_head", head.T, "the head")  # [H, V], contiguous: no transposed GEMM (see module doc)
        self.lm_head: paddle.Tensor | None = top["lm_head"]
        self.lm_head_q: qgemm.QuantLinear | None = top.get("lm_head_q")
        self.lm_head_wo: weight_only.WeightOnlyLinear | None = top.get("lm_head_wo")
        self.norm = t(weights["model.norm.weight"])
        self.layers = []
        for n in range(cfg.num_hidden_layers):
            arrays = layer_arrays(cfg, weights, n, scale)
            layer: dict = {k: None if arrays[k] is None else t(arrays[k]) for k in LAYER_VECTORS}
            moe = arrays.get("moe")
            if moe is not None:
                layer["moe"] = dict(
                    router=t(moe["router"]), experts=[(t(g), t(d)) for g, d in moe["experts"]]
                )
                if "shared" in moe:
                    layer["moe"]["shared"] = tuple(t(x) for x in moe["shared"])
            else:
                dense(layer, "gate_up", arrays["gate_up"], f"layer {n}'s gate|up")
                dense(layer, "down", arrays["down"], f"layer {n}'s down")
            dense(layer, "qkv", arrays["qkv"], f"layer {n}'s q|k|v")
            dense(layer, "o", arrays["o"], f"layer {n}'s o")
            self.layers.append(layer)
        inv_freq = rope_inv_freq(cfg)
        ang = (
            np.arange(cfg.max_position_embeddings, dtype=np.float64)[:, None]
            * np.concatenate([inv_freq, inv_freq])[None, :]
        )
        sign = np.concatenate([-np.ones(hd // 2), np.ones(hd // 2)])
        self.rope = t(np.stack([np.cos(ang), np.sin(ang) * sign], axis=1))  # [P, 2, hd]
        self._scale = scale
        self._swiglu = cpu_swiglu if device == "cpu" else F.swiglu
        self._rms_norm = fused_rms_norm if fused_rms_norm_runs(device) else composed_rms_norm
        # Attention in two C++ calls a layer where they run (not when batch-invariant: a decode's
        # output would come from another route than a chunk's; nor with Qwen3's per-head q/k
        # norms, which come between the projection and RoPE)
        self._attention_threads = threads
        self.attention_kernels = (
            device == "cpu" and not batch_invariant and not cfg.qk_norm and cpu_attention.runs(nh, nkv, hd)
        )
        self.cpu_attention: cpu_attention.LayerShape | None = None  # allocate_kv_cache's
        self.kernel_layers: kernel_layers.KernelLayers | None = None  # and where the kernels take every layer
        self.lm_head_packed = None
        # The GEMMs' route and MKL threads by a step's rows (0 threads: Paddle's own setting,
        # as on a GPU); ``_packed_step``: this step's route
        self._plan = packed_gemm.GemmPlan.always("eager", 0)
        self._packed_step = False
        if gemms not in ("eager", "packed", "auto"):
            raise ValueError(f"gemms must be eager, packed or auto, not {gemms!r}")
        held.say()
        if gemms != "eager" and self.weight_format == "float32":
            self._plan, self.lm_head_packed = pack_weights(self.layers, self.lm_head, gemms == "packed")
        elif self.weight_format != "float32" and not self.gpu_weight_only:
            threads = thread_quantized(self.layers, self.lm_head_q, threads)
            if packed_gemm.available():
                self._plan = packed_gemm.GemmPlan.always("eager", threads)
        # LoRA adapters (add_lora): per slot, per layer, fused projection -> (A [in, R], B [R, out])
        self.loras: dict[int, list[dict[str, tuple[paddle.Tensor, paddle.Tensor]]]] = {}
        self._active: tuple[tuple[list, paddle.Tensor], ...] = ()  # this forward's (layers, rows)
        self.k_blocks: list[paddle.Tensor] = []  # [num_blocks + 1, block_size, kvh, hd]
        self.v_blocks: list[paddle.Tensor] = []
        self.k_slots: list[paddle.Tensor] = []  # the same memory as [slots, kvh, hd]
        self.v_slots: list[paddle.Tensor] = []
        self.k_rows: list[paddle.Tensor] = []  # the same memory as [kvh * blocks, block_size * hd]
        self.v_rows: list[paddle.Tensor] = []
        self.num_blocks_total = 0
        self.block_size = 0
        self.trash_slot = 0

    @property
    def gemms(self) -> str:
        """Which GEMMs the model runs: ``packed``, ``eager``, or the plan by rows where it mixes
        them (``packed on 1 thread(s) at 1-3 rows, ...``)."""
        routes = self._plan.routes
        return next(iter(routes)) if len(routes) == 1 else str(self._plan)

    @property
    def gemm_plan(self) -> packed_gemm.GemmPlan:
        return self._plan

    @property
    def gemm_threads(self) -> int:
        """The most MKL threads any step's GEMMs take (0: Paddle's own setting)."""
        return self._plan.max_threads

    def _mm(self, x: paddle.Tensor, layer: dict, name: str) -> paddle.Tensor:
        """``x @ layer[name]``: over the quantized or packed weight where there is one, else
        eager."""
        q = layer.get(name + "_q")
        if q is not None:
            return q(x)
        wo = layer.get(name + "_wo")
        if wo is not None:
            return wo(x)
        if self._packed_step:
            packed = layer.get(name + "_packed")
            if packed is not None:
                return packed(x)
        return paddle.matmul(x, layer[name])

    # ------------------------------------------------------------------ LoRA

    def add_lora(self, slot: int, adapter) -> None:
        """An adapter (fd.engine.model.lora.Adapter) as ``slot``: for each of the fused projections
        (q|k|v, o, gate|up, down) one ``A`` [in, R] and one block-diagonal ``B`` [R, out], so a
        batch's rows of that adapter cost two small GEMMs a projection. The scale is in ``B``,
        and so is the softmax scale q's columns carry (as the base q weights do)."""
        c = self.cfg
        q_scale = 1.0 if c.qk_norm else float(self._scale)
        fused = {
            "qkv": (("q_proj", q_scale), ("k_proj", 1.0), ("v_proj", 1.0)),
            "o": (("o_proj", 1.0),),
            "gate_up": (("gate_proj", 1.0), ("up_proj", 1.0)),
            "down": (("down_proj", 1.0),),
        }
        from fd.engine.model.lora import module_shape

        layers = []
        for mods in adapter.layers:
            out: dict[str, tuple[paddle.Tensor, paddle.Tensor]] = {}
            for name, parts in fused.items():
                taken = [(m, s) for m, s in parts if m in mods]
                if not taken:
                    continue
                fan_in = module_shape(c, parts[0][0])[0]
                widths = [module_shape(c, m)[1] for m, _ in parts]
                r = sum(mods[m][0].shape[0] for m, _ in taken)
                a = np.zeros((fan_in, r), dtype=np.float32)
                b = np.zeros((r, sum(widths)), dtype=np.float32)
                row = 0
                for (m, s), col, width in zip(parts, np.cumsum([0, *widths[:-1]]), widths, strict=False):
                    if m not in mods:
                        continue
                    am, bm = mods[m]
                    k = am.shape[0]
                    a[:, row : row + k] = am.T
                    b[row : row + k, col : col + width] = bm.T * (adapter.scale * s)
                    row += k
                out[name] = (self.tensor(a), self.tensor(b))
            layers.append(out)
        self.loras[slot] = layers

    def _lora(self, y: paddle.Tensor, x: paddle.Tensor, layer: int, name: str) -> paddle.Tensor:
        """``y`` (the base projection of ``x``) plus each active adapter's on its rows."""
        for layers, rows in self._active:
            ab = layers[layer].get(name)
            if ab is not None:
                d = paddle.matmul(paddle.matmul(paddle.index_select(x, rows), ab[0]), ab[1])
                y = paddle.index_add(y, rows, 0, d)
        return y

    # ------------------------------------------------------------------ cache

    def kv_bytes_per_block(self, block_size: int) -> int:
        c = self.cfg
        return 2 * c.num_hidden_layers * block_size * c.kv_size * 4

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Zeroed (masked keys must be finite: 0 * NaN would poison the output), plus one trash
        block at the end that padding rows write to. Tokens are written by slot and read back
        by whole blocks (a block gather is ~4x faster than a slot gather).

        Head-major, [kvh, blocks, block_size, hd]: gathering a step's blocks of each head (as
        rows of [kvh * blocks, block_size * hd]) gives each KV head's context as attention
        multiplies it, [kvh, S, L, hd], where a token-major
        cache had to transpose all of it, in every layer, every step."""
        c = self.cfg
        self.block_size = block_size
        self.trash_slot = num_blocks * block_size
        self.num_slots = (num_blocks + 1) * block_size
        kvh, hd = c.num_key_value_heads, c.head_dim
        shape = [kvh, num_blocks + 1, block_size * hd]
        self.k_blocks = [paddle.zeros(shape, dtype="float32") for _ in range(c.num_hidden_layers)]
        self.v_blocks = [paddle.zeros(shape, dtype="float32") for _ in range(c.num_hidden_layers)]
        self.num_blocks_total = num_blocks + 1
        # reshapes share the buffer: row h * num_slots + slot is KV head h of that slot, and
        # row h * (num_blocks + 1) + block that head's block
        self.k_rows = [k.reshape([kvh * (num_blocks + 1), block_size * hd]) for k in self.k_blocks]
        self.v_rows = [v.reshape([kvh * (num_blocks + 1), block_size * hd]) for v in self.v_blocks]
        self.k_slots = [k.reshape([kvh * self.num_slots, hd]) for k in self.k_blocks]
        self.v_slots = [v.reshape([kvh * self.num_slots, hd]) for v in self.v_blocks]
        if self.attention_kernels:
            self.cpu_attention = cpu_attention.LayerShape(
                c.num_attention_heads, kvh, hd, block_size, self.num_slots, self._attention_threads
            )
            if kernel_layers.takes(self.layers):
                self.kernel_layers = kernel_layers.KernelLayers(
                    self.layers, self.cpu_attention, self.rope, self.k_blocks, self.v_blocks,
                    c.rms_norm_eps, c.sliding_window,
                )  # fmt: skip

    def pad_rows(self, n: int) -> int:
        a = self.row_align
        return max(a, -(-n // a) * a)

    def tensor(self, a: np.ndarray) -> paddle.Tensor:
        return paddle.to_tensor(a, place=self.place)

    def upload(self, arrays: list[np.ndarray], dtype) -> list[paddle.Tensor]:
        """Several 1-D arrays to the device in one copy."""
        if not arrays:
            return []
        if len(arrays) == 1:
            return [self.tensor(np.asarray(arrays[0], dtype=dtype))]
        sizes = [len(a) for a in arrays]
        return paddle.split(self.tensor(np.concatenate(arrays).astype(dtype, copy=False)), sizes)

    # ------------------------------------------------------------------ forward

    def _projection(self, layer: dict, h: paddle.Tensor, i: int) -> paddle.Tensor:
        """The q|k|v projection [n, (nh + 2 kvh) * hd], LoRA and bias included."""
        a = self._mm(h, layer, "qkv")
        if self._active:
            a = self._lora(a, h, i, "qkv")
        if layer["qkv_b"] is not None:
            a = paddle.add(a, layer["qkv_b"])
        return a

    def _qkv(self, layer: dict, h: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, i: int = 0):
        """Projections with RoPE applied (q already scaled by 1/sqrt(head_dim)).

        rotate_half(x) is ``concat(x2, x1)``, a roll by half a head, with the sign folded into
        the sin table: one cheap copy instead of a matmul or extra projection columns (a roll
        costs a third of a split and a concat).
        """
        c = self.cfg
        n = h.shape[0]
        a = self._projection(layer, h, i)
        heads = c.num_attention_heads + c.num_key_value_heads
        qk, v = paddle.split(a, [heads * c.head_dim, c.kv_size], axis=-1)
        qk = qk.reshape([n, heads, c.head_dim])
        if layer["qk_norm"] is not None:  # Qwen3: each head's q and k RMS-normalised
            qk = composed_rms_norm(qk, layer["qk_norm"], c.rms_norm_eps)[0]
        qk = paddle.add(
            paddle.multiply(qk, cos), paddle.multiply(paddle.roll(qk, c.head_dim // 2, axis=-1), sin)
        )
        q, k = paddle.split(qk, [c.num_attention_heads, c.num_key_value_heads], axis=1)
        return q, k, v.reshape([n, c.num_key_value_heads, c.head_dim])

    def _attend(
        self, q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, mask: paddle.Tensor, s: int, qmax: int
    ) -> paddle.Tensor:
        """q [S*Qmax, nh, hd], k and v [kvh, S, L, hd] (the cache's own layout, so the context
        is used as gathered), mask [kvh, S, Qmax, g, L] -> [S*Qmax, nh*hd]. Only q and the
        output are transposed: Qmax rows a sequence, where the context has L."""
        c = self.cfg
        kvh, g, hd = c.num_key_value_heads, self.group, c.head_dim
        L = k.shape[-2]
        # One query row (a lone decode) already lies as [kvh, g, hd]: no transposes, in or out
        one = s * qmax == 1
        q = (
            q.reshape([kvh, 1, g, hd])
            if one
            else q.reshape([s, qmax, kvh, g, hd]).transpose([2, 0, 1, 3, 4]).reshape([kvh, s, qmax * g, hd])
        )
        scores = paddle.matmul(q, k, transpose_y=True).reshape([kvh, s, qmax, g, L])
        p = F.softmax(paddle.add(scores, mask), axis=-1).reshape([kvh, s, qmax * g, L])
        o = paddle.matmul(p, v)
        if one:
            return o.reshape([1, c.q_size])
        return o.reshape([kvh, s, qmax, g, hd]).transpose([1, 2, 0, 3, 4]).reshape([s * qmax, c.q_size])

    def _mlp_block(self, layer: dict, attn: paddle.Tensor, residual: paddle.Tensor, i: int = 0):
        eps = self.cfg.rms_norm_eps
        x = self._mm(attn, layer, "o")
        if self._active:
            x = self._lora(x, attn, i, "o")
        if layer["o_b"] is not None:
            x = paddle.add(x, layer["o_b"])
        gate_up, down = layer.get("gate_up_q"), layer.get("down_q")
        if not self._active and gate_up is not None and down is not None and down.shape[0] % 16 == 0:
            # (the norm inside the gate|up GEMM, SwiGLU inside the down GEMM)
            g, residual = gate_up.normed(x, residual, layer["post_norm"], eps)
            return down.swiglu(g), residual
        h, residual = self._rms_norm(x, layer["post_norm"], eps, residual)
        if "moe" in layer:
            return self._moe(layer["moe"], h), residual
        if not self._active:
            return self._mm(self._swiglu(self._mm(h, layer, "gate_up")), layer, "down"), residual
        g = self._swiglu(self._lora(self._mm(h, layer, "gate_up"), h, i, "gate_up"))
        return self._lora(self._mm(g, layer, "down"), g, i, "down"), residual

    def _moe(self, moe: dict, h: paddle.Tensor) -> paddle.Tensor:
        """A sparse layer's MLP: each token through its top-k experts by the router's softmax,
        weighted by their probabilities (renormalised over the k with norm_topk_prob), summed
        in expert order (as transformers does). An expert's rows are gathered and padded to whole
        8-row tiles (weight 0), as the dense GEMMs' rows are (see the module doc)."""
        c = self.cfg
        k = c.num_experts_per_tok
        probs = F.softmax(paddle.matmul(h, moe["router"]), axis=-1)
        w, idx = paddle.topk(probs, k, axis=-1)
        if c.norm_topk_prob:
            w = paddle.divide(w, paddle.sum(w, axis=-1, keepdim=True))
        chosen = idx.numpy()
        flat = w.reshape([-1])
        out = paddle.zeros_like(h)
        for e in np.unique(chosen):
            tok, j = np.nonzero(chosen == e)
            n = len(tok)
            pad = self.pad_rows(n) - n
            rows = np.concatenate([tok, np.zeros(pad, dtype=tok.dtype)])
            at = np.concatenate([tok * k + j, np.zeros(pad, dtype=tok.dtype)])
            rows_t, at_t = self.upload([rows, at], np.int64)
            gate_up, down = moe["experts"][e]
            y = paddle.matmul(self._swiglu(paddle.matmul(paddle.index_select(h, rows_t), gate_up)), down)
            scale = paddle.index_select(flat, at_t)
            if pad:
                scale = paddle.multiply(
                    scale, self.tensor(np.r_[np.ones(n), np.zeros(pad)].astype(np.float32))
                )
            out = paddle.index_add(out, rows_t, 0, paddle.multiply(y, scale.unsqueeze(-1)))
        if "shared" in moe:  # Qwen2-MoE: plus the shared expert, gated by a sigmoid
            gate_up, down, gate = moe["shared"]
            y = paddle.matmul(self._swiglu(paddle.matmul(h, gate_up)), down)
            out = paddle.add(out, paddle.multiply(F.sigmoid(paddle.matmul(h, gate)), y))
        return out

    def _layers(self, ids: paddle.Tensor, positions: paddle.Tensor, attention, fused=None) -> paddle.Tensor:
        """The decoder stack; ``attention(i, q, k, v)`` supplies the context, or where given
        ``fused(i, qkv)`` all of a layer's attention from its projection (RoPE included).
        Returns the final normed hidden states [Tp, H]."""
        eps = self.cfg.rms_norm_eps
        # This step's GEMMs by its rows (MKL's threads are per thread: the one running it)
        gemms = self._plan.choice(int(ids.shape[0]))
        self._packed_step = gemms.route == "packed"
        if gemms.threads:
            packed_gemm.use_threads(gemms.threads)
        x = paddle.index_select(self.embed, ids)
        if fused is None:
            cos, sin = paddle.split(paddle.index_select(self.rope, positions), 2, axis=1)  # [T, 1, hd]
            # Broadcast over the heads once a step, not in each layer's RoPE (a broadcasting
            # multiply costs several times a same-shape one: 0.3 ms each for a 528-token prefill).
            heads = [
                cos.shape[0],
                self.cfg.num_attention_heads + self.cfg.num_key_value_heads,
                self.cfg.head_dim,
            ]
            cos, sin = paddle.expand(cos, heads), paddle.expand(sin, heads)
        residual = None
        for i, layer in enumerate(self.layers):
            qkv = layer.get("qkv_q")
            if fused is not None and qkv is not None and not self._active and layer["qkv_b"] is None:
                # (the norm inside the q|k|v GEMM: the kernels' whole path from x to attention)
                a, residual = qkv.normed(x, residual, layer["in_norm"], eps)
                x, residual = self._mlp_block(layer, fused(i, a), residual, i)
                continue
            h, residual = self._rms_norm(x, layer["in_norm"], eps, residual)
            if fused is not None:
                o = fused(i, self._projection(layer, h, i))
            else:
                q, k, v = self._qkv(layer, h, cos, sin, i)
                o = attention(i, q, k, v)
            x, residual = self._mlp_block(layer, o, residual, i)
        return self._rms_norm(x, self.norm, eps, residual)[0]

    @paddle.no_grad()
    def forward(self, b: ForwardBatch) -> paddle.Tensor:
        """Logits [len(logits_index), vocab] of a paged, flattened batch."""
        return self.head(self.hidden(b))

    @paddle.no_grad()
    def head(self, h: paddle.Tensor) -> paddle.Tensor:
        """Logits [rows, vocab] of final hidden states [rows, hidden]."""
        if self.lm_head_q is not None:
            return self.lm_head_q(h)
        if self.lm_head_wo is not None:
            return self.lm_head_wo(h)
        if self._packed_step and self.lm_head_packed is not None:
            return self.lm_head_packed(h)
        return paddle.matmul(h, self.lm_head)

    @paddle.no_grad()
    def hidden(self, b: ForwardBatch) -> paddle.Tensor:
        """The final hidden states [len(logits_index), hidden] of a paged, flattened batch:
        :meth:`forward` without the head, for a caller that takes the logits of many rows a
        slice at a time (a prompt's scores)."""

        if (h := self._kernel_layers(b)) is not None:
            return paddle.index_select(h, b.logits_index)
        c = self.cfg
        kvh, hd = c.num_key_value_heads, c.head_dim
        kernels = self.cpu_attention
        # attention by the kernels reads the cache in place: no mask, no gather (a long chunk's
        # gathers and GEMMs read each key once for all its queries: those stay)
        in_place = [
            kernels is not None and g.lens is not None and g.max_q <= cpu_attention.MAX_CHUNK
            for g in b.groups
        ]
        # the mask broadcast over heads once per step, not once per layer (a broadcasting add
        # costs ~6x a same-shape one)
        masks = [
            None
            if skip
            else paddle.expand(
                g.mask.reshape([1, g.num_seqs, g.max_q, 1, g.num_keys]),
                [kvh, g.num_seqs, g.max_q, self.group, g.num_keys],
            )
            for g, skip in zip(b.groups, in_place, strict=True)
        ]
        n = b.slot_mapping.shape[0]
        # each group's context as rows of the cache seen as [kvh * blocks, block_size * hd]:
        # one gather of whole rows (axis 0) copies it faster than index_select on axis 1
        heads = (
            None
            if all(in_place)
            else paddle.arange(
                0, kvh * self.num_blocks_total, self.num_blocks_total, dtype="int64"
            ).unsqueeze(1)
        )
        ctx_rows = [
            None if skip else paddle.add(g.ctx_blocks.unsqueeze(0), heads).reshape([-1])
            for g, skip in zip(b.groups, in_place, strict=True)
        ]

        def gathered(i: int, grp: AttnGroup, mask, ctx, q) -> paddle.Tensor:
            qg = q if grp.q_index is None else paddle.index_select(q, grp.q_index)
            s, L = grp.num_seqs, grp.num_keys
            kg = paddle.gather(self.k_rows[i], ctx).reshape([kvh, s, L, hd])
            vg = paddle.gather(self.v_rows[i], ctx).reshape([kvh, s, L, hd])
            return self._attend(qg, kg, vg, mask, s, grp.max_q)

        def joined(outs: list[paddle.Tensor]) -> paddle.Tensor:
            o = outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)
            return o if b.out_index is None else paddle.index_select(o, b.out_index)

        # each token's row of each KV head in the head-major cache (allocate_kv_cache), token
        # by token: [n, kvh] as k and v come out of the projection, so they scatter as they are
        # (the general path's: the kernels write the cache by slot)
        heads_of_slots = rows = None
        if kernels is None:
            heads_of_slots = paddle.arange(0, kvh * self.num_slots, self.num_slots, dtype="int64").unsqueeze(
                0
            )
            rows = paddle.add(b.slot_mapping.unsqueeze(1), heads_of_slots).reshape([-1])

        def paged(i: int, q, k, v):
            nonlocal rows
            if b.new_slots is not None and (slots := b.new_slots()) is not None:
                rows = paddle.add(slots.unsqueeze(1), heads_of_slots).reshape([-1])
            paddle.scatter_(self.k_slots[i], rows, k.reshape([n * kvh, hd]), overwrite=True)
            paddle.scatter_(self.v_slots[i], rows, v.reshape([n * kvh, hd]), overwrite=True)
            return joined([gathered(i, *a, q) for a in zip(b.groups, masks, ctx_rows, strict=True)])

        step = (
            None
            if kernels is None
            else cpu_attention.StepAttention(
                kernels,
                b.positions,
                b.slot_mapping,
                self.rope,
                [
                    (g.rows, g.tables, g.lens) if own else None
                    for g, own in zip(b.groups, in_place, strict=True)
                ],
                c.sliding_window,
            )
        )

        def fused(i: int, qkv: paddle.Tensor) -> paddle.Tensor:
            assert step is not None
            if b.new_slots is not None and (slots := b.new_slots()) is not None:
                step.slots = slots
            outs = step.layer(qkv, self.k_blocks[i], self.v_blocks[i])
            return joined(
                [
                    out
                    if out is not None
                    else gathered(i, grp, mask, ctx, step.q_rot.reshape([n, c.num_attention_heads, hd]))
                    for out, grp, mask, ctx in zip(outs, b.groups, masks, ctx_rows, strict=True)
                ]
            )

        self._active = tuple((self.loras[slot], rows) for slot, rows in b.lora)
        try:
            h = self._layers(b.input_ids, b.positions, paged, fused if step is not None else None)
        finally:
            self._active = ()
        return paddle.index_select(h, b.logits_index)

    def _kernel_layers(self, b: ForwardBatch) -> paddle.Tensor | None:
        """The final normed hidden states by :attr:`kernel_layers`, where it takes the step:
        one query a row, every row's attention in place (fd/engine/model/kernel_layers.py)."""
        g = b.groups[0] if len(b.groups) == 1 else None
        rows = int(b.input_ids.shape[0])
        if (
            self.kernel_layers is None
            or g is None
            or b.lora
            or b.out_index is not None
            or g.lens is None
            or g.max_q > cpu_attention.MAX_CHUNK
            or rows > kernel_layers.MAX_ROWS
            or len(g.lens) != rows
        ):
            return None
        x0 = paddle.index_select(self.embed, b.input_ids)
        x, residual = self.kernel_layers.run(
            x0, b.positions, b.slot_mapping, g.rows, g.tables, g.lens, b.new_slots
        )
        return self._rms_norm(x, self.norm, self.cfg.rms_norm_eps, residual)[0]

    @paddle.no_grad()
    def reference_logits(self, token_ids, lora: int | None = None) -> np.ndarray:
        """Logits [len, vocab] by plain full recompute: no cache, no block tables, one sequence
        (with LoRA adapter ``lora`` on every row, if given).

        The ground truth the paged path is tested against; it shares only the per-token math.
        """
        c = self.cfg
        n = len(token_ids)
        tp, L = self.pad_rows(n), pad_keys(n)
        ids = np.zeros(tp, dtype=np.int64)
        ids[:n] = token_ids
        pos = np.zeros(tp, dtype=np.int64)
        pos[:n] = np.arange(n)
        qpos = np.arange(n)
        mask = attention_mask(qpos, L, c.sliding_window)
        mask_t = self.tensor(mask.reshape(1, 1, n, 1, L))
        kv_pad = paddle.zeros([L - n, c.num_key_value_heads, c.head_dim], dtype="float32").to(self.place)
        row_pad = paddle.zeros([tp - n, c.q_size], dtype="float32").to(self.place)

        def full(i: int, q, k, v):
            kk = paddle.concat([k[:n], kv_pad]).transpose([1, 0, 2]).unsqueeze(1)
            vv = paddle.concat([v[:n], kv_pad]).transpose([1, 0, 2]).unsqueeze(1)
            return paddle.concat([self._attend(q[:n], kk, vv, mask_t, 1, n), row_pad])

        if lora is not None:
            self._active = ((self.loras[lora], self.tensor(np.arange(n, dtype=np.int64))),)
        try:
            h = self._layers(self.tensor(ids), self.tensor(pos), full)
        finally:
            self._active = ()
        return self.head(h).numpy()[:n]
