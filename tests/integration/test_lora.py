"""LoRA adapters as vLLM's ``--enable-lora --lora-modules name=path`` serves them: a request
whose ``model`` names an adapter runs with ``W + s·B·A`` on every adapted projection, beside
requests of the base model and of other adapters in the same batch. The reference is a
checkpoint with the adapter merged into its weights: the adapter's output must be that
model's, and the base model's must not change."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import openai
import pytest

from fd.control.events import Final, Request, decode
from fd.control.request_data import RequestData
from fd.control.sampling import SamplingParams
from fd.engine.core.outputs import ScheduledSeq, SchedulerOutput
from fd.engine.model.config import ModelConfig
from fd.engine.model.loader import WeightError, load_model, load_weights
from fd.engine.model.lora import load_adapter, save_adapter
from fd.engine.runner.llm import LLM
from fd.engine.runner.model_runner import ModelRunner

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def _merged(base_dir, adapter_dir, out_dir) -> str:
    """The base checkpoint with the adapter folded into its weights."""
    from safetensors.numpy import save_file

    cfg = ModelConfig.from_dir(str(base_dir))
    ad = load_adapter("x", str(adapter_dir), cfg)
    w = load_weights(str(base_dir), cfg, progress=False)
    for n, mods in enumerate(ad.layers):
        for module, (a, b) in mods.items():
            key = f"model.layers.{n}.{'self_attn' if module in ATTN else 'mlp'}.{module}.weight"
            w[key] = w[key] + ad.scale * (b @ a)
    shutil.copytree(base_dir, out_dir)
    for f in os.listdir(out_dir):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            os.remove(os.path.join(out_dir, f))
    save_file(
        {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in w.items()},
        os.path.join(out_dir, "model.safetensors"),
    )
    return str(out_dir)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """Two adapters (every projection, rank 8; the attention's only, rsLoRA) and their merged
    checkpoints: {name: (adapter dir, merged dir)}."""
    root = tmp_path_factory.mktemp("lora")
    cfg = ModelConfig.from_dir(str(tiny_model_dir))
    save_adapter(str(root / "full"), cfg, rank=8, alpha=16, seed=1)
    save_adapter(str(root / "attn"), cfg, rank=4, alpha=8, seed=2, modules=("q_proj", "v_proj"))
    conf = json.loads((root / "attn" / "adapter_config.json").read_text())
    (root / "attn" / "adapter_config.json").write_text(json.dumps({**conf, "use_rslora": True}))
    return {
        name: (str(root / name), _merged(tiny_model_dir, root / name, root / f"{name}-merged"))
        for name in ("full", "attn")
    }


@pytest.fixture(scope="module")
def lora_runner(tiny_model_dir, adapters):
    return ModelRunner(
        str(tiny_model_dir),
        num_blocks=256,
        block_size=16,
        lora_modules={name: a for name, (a, _) in adapters.items()},
    )


def test_an_adapter_is_its_merged_checkpoint(tiny_model_dir, adapters):
    base = load_model(str(tiny_model_dir), progress=False)
    plain = base.reference_logits(list(range(3, 40)))
    for slot, (name, (adapter_dir, merged_dir)) in enumerate(adapters.items()):
        base.add_lora(slot, load_adapter(name, adapter_dir, base.cfg))
        want = load_model(merged_dir, progress=False).reference_logits(list(range(3, 40)))
        got = base.reference_logits(list(range(3, 40)), lora=slot)
        np.testing.assert_allclose(got, want, atol=2e-4 * np.abs(want).max())
        assert np.abs(got - plain).max() > 0.1  # (the adapter does change the output)
    np.testing.assert_array_equal(base.reference_logits(list(range(3, 40))), plain)  # the base: untouched


def test_one_batch_of_the_base_and_two_adapters(lora_runner, tiny_model_dir, adapters):
    """Each row of a mixed step (a prefill chunk and decodes of different adapters) gets its
    own model's logits."""
    refs = {"": load_model(str(tiny_model_dir), progress=False)}
    refs.update({name: load_model(merged, progress=False) for name, (_, merged) in adapters.items()})
    prompts = {"": list(range(10, 30)), "full": list(range(40, 61)), "attn": list(range(70, 87))}
    seqs, block = [], 1
    for name, ids in prompts.items():
        sp = SamplingParams(temperature=0.0, lora=name)
        table = (block, block + 1)
        block += 2
        seqs.append(ScheduledSeq(f"r-{name}", tuple(ids), 0, table, True, sp, 0))
    got = lora_runner.logits(SchedulerOutput(step=0, seqs=tuple(seqs)))
    for row, (name, ids) in zip(got, prompts.items()):
        want = refs[name].reference_logits(ids)[-1]
        np.testing.assert_allclose(row, want, atol=2e-4 * np.abs(want).max(), err_msg=name or "base")


def test_greedy_output_is_the_merged_models_and_the_prefix_cache_keeps_them_apart(
    lora_runner, tiny_tokenizer, adapters
):
    ids = tiny_tokenizer.encode(
        "The harbour town woke slowly on winter mornings, and the boats went out "
        "before the sun was up over the hills"
    )
    assert len(ids) > 32  # (two full blocks a later request could take from the cache)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = {
        name: LLM(ModelRunner(merged, num_blocks=64), tiny_tokenizer).generate([ids], sp)[0].token_ids
        for name, (_, merged) in adapters.items()
    }
    lora = {name: SamplingParams(**{**sp.to_dict(), "lora": name}) for name in adapters}
    # one at a time on one scheduler, with prefix caching: the base's blocks are cached first
    llm = LLM(lora_runner, tiny_tokenizer, max_num_seqs=1)
    outs = llm.generate([ids] * 4, [sp, lora["full"], lora["attn"], lora["full"]])
    base = outs[0].token_ids
    assert [o.token_ids for o in outs[1:]] == [want["full"], want["attn"], want["full"]]
    assert base not in want.values()
    # only the adapter's own blocks came from the cache (the second "full": two blocks)
    assert llm.last_cache_hits == 32
    # and all three at once
    outs = LLM(lora_runner, tiny_tokenizer).generate([ids] * 3, [sp, lora["full"], lora["attn"]])
    assert [o.token_ids for o in outs] == [base, want["full"], want["attn"]]


async def test_the_openai_client_names_an_adapter_as_its_model(
    embedded_redis, keys, tiny_model_dir, tiny_tokenizer, lora_runner, adapters
):
    from fd.api.config import ApiConfig
    from fd.compose import join_in_process, start_api, start_engine
    from fd.control.metrics import Metrics
    from fd.engine.node.node_config import EngineConfig

    mods = {name: a for name, (a, _) in adapters.items()}
    eng = await start_engine(
        embedded_redis.client,
        keys,
        EngineConfig(model_dir=str(tiny_model_dir), engine_id="e-lora", lora_modules=mods),
        runner=lora_runner,
        tokenizer=tiny_tokenizer,
        metrics=Metrics(),
    )
    api = await start_api(
        embedded_redis.client,
        keys,
        ApiConfig(model_dir=str(tiny_model_dir), lora_modules=mods),
        tokenizer=tiny_tokenizer,
    )
    join_in_process(api, eng)
    client = openai.AsyncOpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0)
    try:
        cards = {m.id: m for m in (await client.models.list()).data}
        assert set(cards) == {api.cfg.model_name, "full", "attn"}
        assert (
            cards["full"].model_extra["parent"] == api.cfg.model_name
            and cards["full"].model_extra["root"] == mods["full"]
        )
        ids = tiny_tokenizer.encode("Once upon a time")
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        for name in (api.cfg.model_name, "full", "attn"):
            ref = (
                LLM(ModelRunner(adapters[name][1], num_blocks=64), tiny_tokenizer)
                if name in adapters
                else LLM(ModelRunner(str(tiny_model_dir), num_blocks=64), tiny_tokenizer)
            )
            want = ref.generate([ids], sp)[0].text
            c = await client.completions.create(
                model=name, prompt=ids, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
            )
            assert c.model == name and c.choices[0].text == want, name
            s = await client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
            )
            assert [ch.model async for ch in s] and True
        reqs = [decode(f, e) for e, f in await api.bus.redis.xrange(api.bus.keys.req(c.id))]
        assert reqs[0].model == "attn"
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="nope", prompt="x", max_tokens=1)
        # an adapter the engine lacks (a hand-written request): an error final, not a crash
        await api.bus.submit(
            Request(
                request_id="no-adapter",
                data=RequestData(
                    prompt_token_ids=(1, 2, 3), sampling=SamplingParams(max_tokens=2, lora="missing")
                ),
            ),
            __import__("fd.control.events", fromlist=["Accepted"]).Accepted(request_id="no-adapter"),
        )
        for _ in range(200):
            story = [decode(f, e) for e, f in await api.bus.redis.xrange(api.bus.keys.req("no-adapter"))]
            if story and isinstance(story[-1], Final):
                break
            await __import__("asyncio").sleep(0.02)
        assert story[-1].finish_reason == "error" and "missing" in story[-1].error
    finally:
        await client.close()
        await api.stop()
        await eng.stop()


def test_what_an_adapter_may_not_be(tiny_model_dir, tmp_path):
    cfg = ModelConfig.from_dir(str(tiny_model_dir))
    good = tmp_path / "good"
    save_adapter(str(good), cfg, rank=4, alpha=4)
    with pytest.raises(WeightError, match="rank 4, more than --max-lora-rank 2"):
        load_adapter("a", str(good), cfg, max_rank=2)
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        load_adapter("a", str(tmp_path), cfg)
    conf = json.loads((good / "adapter_config.json").read_text())
    for bad, match in (
        ({"use_dora": True}, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"peft_type": "IA3"}, "IA3"),
        ({"r": 8}, "shape"),
    ):
        d = tmp_path / f"bad{len(os.listdir(tmp_path))}"
        shutil.copytree(good, d)
        (d / "adapter_config.json").write_text(json.dumps({**conf, **bad}))
        with pytest.raises(WeightError, match=match):
            load_adapter("a", str(d), cfg)


def test_the_flags(tmp_path):
    from fd.cli.args import lora_modules
    from fd.cli.main import build_parser

    args = build_parser().parse_args(
        ["serve", "--enable-lora", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}']
    )
    assert lora_modules(args) == {"a": "/x", "b": "/y"}
    with pytest.raises(SystemExit, match="--enable-lora"):
        lora_modules(build_parser().parse_args(["serve", "--lora-modules", "a=/x"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", "nopath"])
    assert lora_modules(build_parser().parse_args(["api", "--enable-lora", "--lora-modules", "a=/x"])) == {
        "a": "/x"
    }
    from fd.cli.args import vllm_compat

    notes = vllm_compat(build_parser().parse_args(["serve", "--enable-lora", "--max-loras", "4"]))
    assert any("--max-loras" in n for n in notes)


# ----------------------------------------------------------------------------- at run time


async def test_adapters_loaded_and_unloaded_at_run_time(
    embedded_redis, keys, tiny_model_dir, tiny_tokenizer, adapters, tmp_path
):
    """vLLM's /v1/load_lora_adapter over the event log: every engine loads it (one told by the
    control stream, one started later from P:loras), requests to any replica may then name it
    and get the merged model's output; a load that fails anywhere is taken back everywhere;
    an unloaded adapter takes no new request, and one running with it finishes."""
    import asyncio

    import aiohttp

    from fd.api.config import ApiConfig
    from fd.compose import join_in_process, start_api, start_engine
    from fd.control.metrics import Metrics
    from fd.engine.node.node_config import EngineConfig

    def runner():
        return ModelRunner(str(tiny_model_dir), num_blocks=256, block_size=16)

    e1 = await start_engine(
        embedded_redis.client,
        keys,
        EngineConfig(model_dir=str(tiny_model_dir), engine_id="rt1"),
        runner=runner(),
        tokenizer=tiny_tokenizer,
        metrics=Metrics(),
    )
    api = await start_api(
        embedded_redis.client,
        keys,
        ApiConfig(model_dir=str(tiny_model_dir), runtime_lora=True, admin_key="adm"),
        tokenizer=tiny_tokenizer,
    )
    other = await start_api(
        embedded_redis.client, keys, ApiConfig(model_dir=str(tiny_model_dir)), tokenizer=tiny_tokenizer
    )  # (a replica without the routes)
    join_in_process(api, e1)
    engines = [e1]
    admin = {"Authorization": "Bearer adm"}
    client = openai.AsyncOpenAI(base_url=f"{other.url}/v1", api_key="none", max_retries=0)
    try:
        async with aiohttp.ClientSession() as s:

            async def post(path, body, headers=admin, base=api.url):
                async with s.post(f"{base}{path}", json=body, headers=headers) as r:
                    return r.status, await r.text()

            ids = tiny_tokenizer.encode("Once upon a time")
            sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            want = (
                LLM(ModelRunner(adapters["full"][1], num_blocks=64), tiny_tokenizer)
                .generate([ids], sp)[0]
                .text
            )
            with pytest.raises(openai.NotFoundError):
                await client.completions.create(model="live", prompt=ids, max_tokens=1)
            assert (
                await post(
                    "/v1/load_lora_adapter",
                    {"lora_name": "live", "lora_path": adapters["full"][0]},
                    headers={},
                )
            )[0] == 401  # the admin key's
            status, text = await post(
                "/v1/load_lora_adapter", {"lora_name": "live", "lora_path": adapters["full"][0]}
            )
            assert status == 200 and text == "Success: LoRA adapter 'live' added successfully."
            assert "live" in (await api.bus.engines())["rt1"]["loras"].split(",")
            # through the other replica, which learns the name from P:loras
            c = await client.completions.create(
                model="live", prompt=ids, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
            )
            assert c.model == "live" and c.choices[0].text == want
            assert "live" in {m.id for m in (await client.models.list()).data}
            assert (
                await post("/v1/load_lora_adapter", {"lora_name": "live", "lora_path": adapters["attn"][0]})
            )[0] == 400

            # an engine that starts now loads what P:loras holds
            e2 = await start_engine(
                embedded_redis.client,
                keys,
                EngineConfig(model_dir=str(tiny_model_dir), engine_id="rt2"),
                runner=runner(),
                tokenizer=tiny_tokenizer,
                metrics=Metrics(),
            )
            engines.append(e2)
            assert "live" in e2.node.adapters.ready

            # a load one engine cannot make is taken back from all
            bad = tmp_path / "bad"
            shutil.copytree(adapters["full"][0], bad)
            (bad / "adapter_config.json").write_text(json.dumps({"r": 8, "use_dora": True}))
            status, text = await post("/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": str(bad)})
            assert status == 400 and "use_dora" in text
            assert "broken" not in await api.bus.loras()
            assert (
                status == 400
                and (await post("/v1/load_lora_adapter", {"lora_name": "x y", "lora_path": "/p"}))[0] == 400
            )

            # unloading: a request running with it finishes; new ones are refused
            running = asyncio.create_task(
                client.completions.create(
                    model="live", prompt=ids, max_tokens=200, temperature=0, extra_body={"ignore_eos": True}
                )
            )
            for _ in range(200):
                if any(e.node.adapters and e.node.requests.using_lora("live") for e in engines):
                    break
                await asyncio.sleep(0.01)
            status, text = await post("/v1/unload_lora_adapter", {"lora_name": "live"})
            assert status == 200 and text == "Success: LoRA adapter 'live' removed successfully."
            done = await running
            long_want = (
                LLM(ModelRunner(adapters["full"][1], num_blocks=64), tiny_tokenizer)
                .generate([ids], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))[0]
                .text
            )
            assert done.choices[0].finish_reason == "length" and done.choices[0].text == long_want
            await asyncio.sleep(0.05)  # (the other replica reads P:loras again after REFRESH_S)
            with pytest.raises(openai.NotFoundError):
                await client.completions.create(model="live", prompt=ids, max_tokens=1)
            for e in engines:
                for _ in range(100):
                    if "live" not in getattr(e.node.runner, "lora_slots", {}):
                        break
                    await asyncio.sleep(0.02)
                assert "live" not in e.node.adapters.ready and "live" not in e.node.runner.lora_slots
            assert (await post("/v1/unload_lora_adapter", {"lora_name": "live"}))[0] == 404
        # without --allow-runtime-lora-updating the routes are not there (as vLLM's), nor in
        # the OpenAPI document
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{other.url}/v1/load_lora_adapter", json={}) as r:
                assert r.status == 404
            for base, there in ((api.url, True), (other.url, False)):
                async with s.get(f"{base}/openapi.json") as r:
                    assert ("/v1/load_lora_adapter" in (await r.json())["paths"]) == there
    finally:
        await client.close()
        await other.stop()
        await api.stop()
        for e in engines:
            await e.stop()


def test_an_engines_adapters_as_the_control_stream_changes_them():
    from fd.engine.core.adapters import Adapters

    a = Adapters(("static",))
    assert a.want_load("x") and not a.want_load("x") and not a.want_load("static")  # (once; not twice)
    assert (
        a.loaded("x", None) == "ready" and "x" in a.ready and a.loaded("x", None) is None
    )  # (an unload's answer)
    assert a.want_load("bad") and a.loaded("bad", "no such file") == "failed" and "bad" not in a.ready
    assert a.status() == {"loras": "static,x", "lora_errors": '{"bad":"no such file"}'}
    assert not a.unload("static", in_use=False) and "static" in a.ready  # given at start: stays
    assert not a.unload("x", in_use=True) and "x" not in a.ready  # no new request; the worker keeps it...
    assert not a.done_with("x", in_use=True) and a.done_with("x", in_use=False)  # ...until the last one ends
    assert not a.unload("bad", in_use=False) and a.status()["lora_errors"] == ""
    # taken back while it loads: forgotten once loaded, and a new load meanwhile is an error
    assert a.want_load("slow") and not a.unload("slow", in_use=False)
    assert not a.want_load("slow") and "still being unloaded" in a.errors["slow"]
    assert a.loaded("slow", None) == "unload" and "slow" not in a.ready
    assert a.unload("slow", in_use=False) is False and a.want_load("slow")  # (then it loads afresh)
