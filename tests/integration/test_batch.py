"""``fd run-batch`` (vLLM's ``run-batch``): OpenAI's batch file format in, one answer a line out,
in the input's order; a bad line is an error line and the batch goes on."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import orjson

from fd.control.events import Accepted, decode
from fd.control.sampling import SamplingParams
from fd.engine.runner.llm import LLM
from fd.tools.batch import BatchLine, parse_line, run_batch


def _line(custom_id, url, body, method="POST") -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def test_what_a_line_may_be():
    assert parse_line(_line("a", "/v1/completions", {"prompt": "x"}), 1) == BatchLine(
        "a", "/v1/completions", {"prompt": "x"}
    )
    for raw, says in (
        (b"{nope", "not JSON"),
        (b"[1]", "not a JSON object"),
        (_line(5, "/v1/completions", {}), "custom_id"),
        (_line("a", "/v1/completions", {}, method="GET"), "POST"),
        (_line("a", "/v1/files", {}), "url must be one of"),
        (_line("a", "/v1/completions", "x"), "body must be"),
        (_line("a", "/v1/completions", {"prompt": "x", "stream": True}), "cannot stream"),
    ):
        err = parse_line(raw, 7)
        assert (
            isinstance(err, dict) and says in err["error"]["message"] and "line 7" in err["error"]["message"]
        )


async def test_a_batch_through_the_api(served, tiny_runner, tiny_tokenizer):
    api, _ = served
    ids = tiny_tokenizer.encode("Hello there")
    want = (
        LLM(tiny_runner, tiny_tokenizer)
        .generate([ids], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
        .text
    )
    lines = [
        _line(
            "greedy",
            "/v1/completions",
            {"prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
        ),
        _line(
            "chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        ),
        b"this is not json\n",
        b"   \n",  # (blank: skipped)
        _line("vectors", "/v1/embeddings", {"input": ["a", "b"]}),
        _line("refused", "/v1/completions", {"prompt": "x", "max_tokens": 0}),
        _line("ranked", "/v1/rerank", {"query": "a", "documents": ["b", "a"]}),
    ]
    out = io.BytesIO()
    ok, failed = await run_batch(api.url, lines, out, concurrency=3, progress=False)
    assert (ok, failed) == (4, 2)
    got = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [g["custom_id"] for g in got] == ["greedy", "chat", None, "vectors", "refused", "ranked"]
    assert [g["response"]["status_code"] for g in got] == [200, 200, 400, 200, 400, 200]
    assert got[0]["response"]["body"]["choices"][0]["text"] == want and got[0]["error"] is None
    assert got[1]["response"]["body"]["object"] == "chat.completion"
    assert "not JSON" in got[2]["error"]["message"]
    assert len(got[3]["response"]["body"]["data"]) == 2
    assert got[4]["error"]["param"] == "max_tokens" and got[4]["response"]["body"]["error"] == got[4]["error"]
    assert [r["index"] for r in got[5]["response"]["body"]["results"]] == [1, 0]
    # each answered request is one of the event log's, under the id the output line gives
    rid = got[0]["response"]["request_id"]
    story = [decode(f, e) for e, f in await api.bus.redis.xrange(api.bus.keys.req(rid))]
    assert isinstance(story[0], Accepted) and story[-1].finish_reason == "length"


def test_fd_run_batch_serves_a_file_by_itself(tiny_model_dir, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    # (ignore_eos: sampled, the random model ends "Say k" within 3 tokens now and then: "Say 3" 8%)
    src.write_bytes(
        b"\n".join(
            [
                _line(f"r{k}", "/v1/completions", {"prompt": f"Say {k}", "max_tokens": 3, "ignore_eos": True})
                for k in range(5)
            ]
            + [b"oops"]
        )
        + b"\n"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "fd",
            "run-batch",
            "-i",
            str(src),
            "-o",
            str(dst),
            "--model",
            str(tiny_model_dir),
            "--executor",
            "paddle-thread",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "5 succeeded, 1 failed" in r.stderr
    got = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [g["custom_id"] for g in got] == [f"r{k}" for k in range(5)] + [None]
    assert all(g["response"]["body"]["usage"]["completion_tokens"] == 3 for g in got[:5])
