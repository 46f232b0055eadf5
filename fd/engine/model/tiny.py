"""A tiny random-weight Llama with a real tokenizer, made locally (no downloads).

Its shape matches the model the speed targets were measured with (TARGETS.md): hidden 128,
2 layers, 4 heads / 2 KV heads, intermediate 256, vocab 512, float32. The tokenizer is a real
byte-level BPE trained here on the text below, so any UTF-8 round-trips (unknown characters
fall back to single bytes) and streaming must deal with characters split across tokens.
Everything is derived from ``seed``: the same seed gives byte-identical files.
"""

from __future__ import annotations

import json
import os

import numpy as np

SPECIAL_TOKENS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")

# ChatML; with tools, Qwen 2.5's way of offering them (a system turn listing their JSON) and of
# writing earlier calls and their results, which fd's hermes tool-call parser reads back.
CHATML_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags.<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' "
    "+ (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = """\
The harbour town woke slowly on winter mornings. Fishermen checked their nets while the baker
opened the shutters, and the smell of warm bread drifted down to the water. Children ran along
the sea wall, counting the boats that came back with the tide: one, two, three, and sometimes
twelve or more when the weather had been kind.

A request arrives at the server, waits in a queue, and is scheduled when there is room in the
cache. The engine reads the prompt, computes the keys and values for every token, and then
generates one new token at a time. When the client hangs up, the request is aborted and its
memory is returned to the pool, so that the next request can start without delay.

Good software is written for the people who read it later. Small functions with clear names,
tests that fail when the behaviour changes, and documentation that explains why a decision was
made are worth more than clever tricks. Measure before you optimise, and measure again after.

The library was quiet in the afternoon. A student turned the pages of an old atlas, tracing
rivers with her finger from the mountains to the sea. Outside, the rain stopped, the clouds
opened, and a pale light fell across the tables, the chairs, and the long rows of books.

What is the capital of France? Paris is the capital of France. How many days are in a week?
There are seven days in a week. Please write a short poem about the moon. The moon is a silver
coin in the pocket of the night, and the stars are the change it gives to those who wander.

Numbers and symbols matter too: 0 1 2 3 4 5 6 7 8 9, 10%, $25.00, 3.14, (a + b) * c = d,
"quoted text", user@example.com, https://example.org/path?query=value#anchor, and a list:
first, second, third; yes or no? Of course! It's done.
"""


def train_tokenizer(vocab: int):
    """A byte-level BPE with exactly ``vocab`` tokens, special tokens first (ids 0..3)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    if tok.get_vocab_size() != vocab:
        raise ValueError(f"the embedded corpus yields {tok.get_vocab_size()} tokens, not {vocab}")
    return tok


def random_weights(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """HF-named float32 weights. Scales are chosen so the residual branches matter and greedy
    decoding wanders over the vocabulary instead of repeating one token."""
    rng = np.random.default_rng(seed)
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    q_out, kv_out = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def mat(out: int, inp: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((out, inp)) * (gain / np.sqrt(inp))).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, h)).astype(np.float32)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = mat(q_out, h, 2.0)
        w[p + "self_attn.k_proj.weight"] = mat(kv_out, h, 2.0)
        w[p + "self_attn.v_proj.weight"] = mat(kv_out, h)
        w[p + "self_attn.o_proj.weight"] = mat(h, q_out, 2.0)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "mlp.gate_proj.weight"] = mat(inter, h)
        w[p + "mlp.up_proj.weight"] = mat(inter, h)
        w[p + "mlp.down_proj.weight"] = mat(h, inter, 2.0)
    w["model.norm.weight"] = norm(h)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = mat(vocab, h, 4.0)
    return w


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")


def make_tiny_model(
    dir: str,
    seed: int = 0,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 256,
    vocab: int = 512,
    max_position_embeddings: int = 2048,
) -> str:
    """Write an HF-format model directory at ``dir`` and return its path."""
    from safetensors.numpy import save_file

    os.makedirs(dir, exist_ok=True)
    tok = train_tokenizer(vocab)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    eos = [ids["</s>"], ids["<|im_end|>"]]
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "intermediate_size": intermediate,
        "vocab_size": vocab,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": ids["<s>"],
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    _write_json(os.path.join(dir, "config.json"), cfg)
    _write_json(
        os.path.join(dir, "generation_config.json"),
        {"bos_token_id": ids["<s>"], "eos_token_id": eos, "do_sample": False},
    )
    _write_json(
        os.path.join(dir, "tokenizer_config.json"),
        {
            "bos_token": "<s>",
            "eos_token": "<|im_end|>",
            "chat_template": CHATML_TEMPLATE,
            "model_max_length": max_position_embeddings,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    with open(os.path.join(dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tok.to_str(pretty=True))
    weights = os.path.join(dir, "model.safetensors")
    save_file(random_weights(cfg, seed), weights, metadata={"format": "pt"})
    os.chmod(weights, 0o644)  # safetensors writes 0600; a server running as another user reads it
    return dir
