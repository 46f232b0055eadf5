"""The model in a worker process: the same tokens as in-process, errors that say what broke,
and no worker outliving its engine."""

from __future__ import annotations

import time

import pytest

from fd.control.sampling import SamplingParams
from fd.engine.runner.llm import LLM
from fd.engine.runner.runners import LoraDone
from fd.engine.runner.worker import ProcessRunner, WorkerError


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    runner = ProcessRunner(str(tiny_model_dir), num_blocks=256, block_size=16, batch_invariant=True)
    runner.warmup()
    yield runner
    runner.close()


def test_worker_gives_the_same_tokens_as_in_process(worker, tiny_runner, tiny_tokenizer):
    prompts = [tiny_tokenizer.encode(t) for t in ("Hello there", "a", "The quick brown fox jumps")]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True)
    # penalties on repeats (the request's history crosses the pipe; the worker adds the token
    # it sampled a step earlier), a bias, and a floor on the length
    shaped = SamplingParams(
        temperature=0.0,
        max_tokens=20,
        frequency_penalty=-0.5,
        repetition_penalty=0.8,
        logit_bias=((7, 2.0),),
        min_tokens=5,
    )
    for sp in (greedy, seeded, shaped):
        here = LLM(tiny_runner, tiny_tokenizer).generate(prompts, sp)
        there = LLM(worker, tiny_tokenizer).generate(prompts, sp)
        assert [g.token_ids for g in there] == [g.token_ids for g in here]
        # async scheduling: the worker fills each placeholder with the token it sampled a step
        # earlier, which the engine has not seen yet
        ahead = LLM(worker, tiny_tokenizer, async_scheduling=True).generate(prompts, sp)
        assert [g.token_ids for g in ahead] == [g.token_ids for g in here]
    assert worker.busy_seconds > 0
    assert worker.num_blocks == 256 and worker.vocab_size == tiny_runner.vocab_size
    # log-probabilities come back over the pipe as the in-process runner makes them
    from fd.engine.core.outputs import ScheduledSeq, SchedulerOutput

    want = SamplingParams(temperature=0.0, logprobs=3)
    step = SchedulerOutput(step=-1, seqs=(ScheduledSeq("lp", tuple(prompts[2]), 0, (0, 1), True, want, 0),))
    there, here = worker.execute(step), tiny_runner.execute(step)
    assert there.sampled == here.sampled and set(there.logprobs) == {"lp"}
    (lp, top), (lp0, top0) = there.logprobs["lp"], here.logprobs["lp"]
    assert lp == pytest.approx(lp0) and [t for t, _ in top] == [t for t, _ in top0] and len(top) == 3
    assert top[0][0] == there.sampled["lp"] and top[0][1] == pytest.approx(lp)
    # and the prompt's scores (echo): a chunk that is not the prompt's last, scored up to the
    # token after it, which crosses the pipe with it
    score = SamplingParams(temperature=0.0, prompt_logprobs=2)
    chunk = ScheduledSeq(
        "pl",
        tuple(prompts[2][:8]),
        0,
        (0, 1),
        False,
        score,
        0,
        prompt_len=len(prompts[2]),
        prompt_next=prompts[2][8],
    )
    there, here = (r.execute(SchedulerOutput(step=-1, seqs=(chunk,))) for r in (worker, tiny_runner))
    (first, entries), (first0, entries0) = there.prompt_logprobs["pl"], here.prompt_logprobs["pl"]
    assert first == first0 == 1 and len(entries) == len(entries0) == 8
    assert [e[0] for e in entries] == pytest.approx([e[0] for e in entries0])
    assert [e[2] for e in entries] == [e[2] for e in entries0]  # (each token's rank)
    assert worker.eos_token_ids == tuple(tiny_runner.eos_token_ids)


def test_a_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(WorkerError, match="FileNotFoundError: model directory .*nowhere does not exist"):
        ProcessRunner(str(tmp_path / "nowhere"))


def test_worker_exits_when_its_engine_goes_away(tiny_model_dir):
    runner = ProcessRunner(str(tiny_model_dir), num_blocks=16)
    proc = runner._proc
    assert proc.is_alive()
    runner._conn.close()  # what the kernel does to the pipe when the engine dies, SIGKILL too
    deadline = time.monotonic() + 10
    while proc.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not proc.is_alive()


def _two_steps_ahead(worker):
    """A scheduler with "a" (a 1,500-token prefill that keeps the worker busy) and "b", and
    its first two steps, the second decided ahead (decodes on placeholders)."""
    from fd.control.request_data import RequestData
    from fd.engine.core.config import SchedulerConfig
    from fd.engine.core.scheduler import Scheduler

    sched = Scheduler(
        SchedulerConfig(
            num_blocks=worker.num_blocks,
            block_size=16,
            max_num_batched_tokens=4096,
            max_model_len=worker.max_model_len,
            max_steps_in_flight=2,
        )
    )
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    sched.add("a", RequestData(prompt_token_ids=tuple(i % 300 + 5 for i in range(1500)), sampling=sp))
    sched.add("b", RequestData(prompt_token_ids=(5, 6, 7), sampling=sp))
    out1 = sched.schedule()
    return sched, out1, sched.schedule()


def test_a_dropped_request_is_left_out_of_a_queued_step_and_the_worker_says_so(worker):
    """Async scheduling queues step N+1 behind N; an abort that arrives meanwhile reaches the
    worker (``drop``) while N runs. N+1 then runs without the request, and the worker says so
    at once; N stops writing its KV at its next layer and says so too, before N's result, so
    the engine can release its blocks before N ends."""
    sched, out1, out2 = _two_steps_ahead(worker)
    heard = []
    worker.on_skipped = lambda step, rids: heard.append((step, list(rids)))
    try:
        worker.submit(out1)
        worker.submit(out2)
        worker.drop(out2.step, ["a"])
        r1 = worker.collect()
        # out1 stopped writing a's KV mid-step (or, if the drop got there before out1 started,
        # left it out): either way a note for each step, and no token of a's from out1
        assert sorted(heard) == [(out1.step, ["a"]), (out2.step, ["a"])]
        assert set(r1.sampled) == {"b"}
        early = list(heard)
        r2 = worker.collect()
        assert heard == early  # nothing more to say
        assert set(r2.sampled) == {"b"}
    finally:
        worker.on_skipped = None
    # and the step after knows nothing of the drop any more
    sched.abort("a", "http")
    for step, rids in early:
        sched.skipped(step, rids)
    sched.update(out1, r1)
    sched.skipped(out2.step, ["a"])
    sched.update(out2, r2)
    assert not sched.knows("a")
    out3 = sched.schedule()
    worker.submit(out3)
    assert set(worker.collect().sampled) == {"b"}


def test_the_pipe_form_of_a_step_round_trips_and_sends_sampling_once():
    """Steps cross the pipe as tuples with each request's SamplingParams sent once (then a
    number); what the worker rebuilds equals what the engine scheduled, across a reset."""
    import pickle

    from fd.engine.core.outputs import ScheduledSeq, SchedulerOutput
    from fd.engine.runner.worker_messages import StepDecoder, StepEncoder

    a = SamplingParams(temperature=0.0, max_tokens=5)
    b = SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=9, stop=("x",))
    enc, dec = StepEncoder(), StepDecoder()

    def step(n, *seqs):
        return SchedulerOutput(step=n, num_batched_tokens=sum(len(s.token_ids) for s in seqs), seqs=seqs)

    s1 = step(
        1, ScheduledSeq("r1", (5, 6, 7), 0, (3,), True, a, 0), ScheduledSeq("r2", (8,), 4, (1, 2), True, b, 2)
    )
    s2 = step(
        2,
        ScheduledSeq("r1", (-1,), 3, (3,), True, a, 1),
        ScheduledSeq("r2", (-1,), 5, (1, 2), True, b, 3, (8, 9, 9, 4, 4, 7), 4),
    )
    m1, m2 = enc.encode(s1), enc.encode(s2)
    assert len(m1.new) == 2 and m2.new == []  # the params went once
    assert dec.decode(pickle.loads(pickle.dumps(m1))) == s1
    assert dec.decode(pickle.loads(pickle.dumps(m2))) == s2
    enc.MAX_PARAMS = 0  # force the reset: the worker forgets, the params are sent again
    m3 = enc.encode(s2)
    assert m3.reset and len(m3.new) == 2 and dec.decode(m3) == s2


def test_replies_are_read_without_waiting_skips_before_their_step(worker):
    """What an engine's event loop does with a worker (no thread): wait until the pipe is
    readable, take what came. The same results, in order, and a drop's note before the
    result of the step it left the request out of."""
    import select

    from fd.engine.core.outputs import RunnerOutput

    _, out1, out2 = _two_steps_ahead(worker)
    assert worker.take_ready() == []  # nothing has come: no wait
    worker.submit(out1)
    worker.submit(out2)
    worker.drop(out2.step, ["a"])
    replies: list = []
    deadline = time.monotonic() + 30
    while sum(isinstance(r, RunnerOutput) for r in replies) < 2 and time.monotonic() < deadline:
        select.select([worker.fileno()], [], [], 1.0)
        replies += worker.take_ready()
    said = [
        ("result", r.step) if isinstance(r, RunnerOutput) else ("skipped", r.step, list(r.request_ids))
        for r in replies
        if not isinstance(r, LoraDone)
    ]
    assert [x for x in said if x[0] == "result"] == [("result", out1.step), ("result", out2.step)]
    assert said.index(("skipped", out2.step, ["a"])) < said.index(("result", out2.step))
    assert set(replies[-1].sampled) == {"b"}


def test_a_dead_worker_is_an_error_for_a_reader_too(tiny_model_dir):
    import select

    runner = ProcessRunner(str(tiny_model_dir), num_blocks=16)
    try:
        runner._proc.kill()
        runner._proc.join()
        assert select.select([runner.fileno()], [], [], 10)[0]  # readable: the end of the pipe
        with pytest.raises(WorkerError, match="died"):
            runner.take_ready()
    finally:
        runner.close()


def test_vectors_and_adapters_cross_the_pipe(tiny_model_dir, tiny_runner, tiny_tokenizer, tmp_path):
    """An embeddings request's vector comes back from the worker as from an in-process
    runner, and adapters given to the worker are loaded there and named to the engine."""
    from fd.engine.model.config import ModelConfig
    from fd.engine.model.lora import save_adapter
    from fd.engine.runner.model_runner import ModelRunner

    ids = [tiny_tokenizer.encode("Hello there"), tiny_tokenizer.encode("The quick brown fox")]
    save_adapter(str(tmp_path / "ad"), ModelConfig.from_dir(str(tiny_model_dir)), rank=4, alpha=8)
    mods = {"ad": str(tmp_path / "ad")}
    runner = ProcessRunner(
        str(tiny_model_dir), num_blocks=64, block_size=16, lora_modules=mods, batch_invariant=True
    )
    try:
        assert runner.lora_names == ("ad",)
        assert LLM(runner, tiny_tokenizer).embed(ids) == LLM(tiny_runner, tiny_tokenizer).embed(ids)
        sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, lora="ad")
        here = ModelRunner(str(tiny_model_dir), num_blocks=64, lora_modules=mods, batch_invariant=True)
        assert [g.token_ids for g in LLM(runner, tiny_tokenizer).generate(ids, sp)] == [
            g.token_ids for g in LLM(here, tiny_tokenizer).generate(ids, sp)
        ]
        # at run time: at start (nothing in flight) the answer is waited for; while steps run
        # it comes among the replies, after the steps sent before it
        assert runner.load_lora("late", mods["ad"], wait=True) is None
        assert "FileNotFoundError" in runner.load_lora("nowhere", str(tmp_path / "nowhere"), wait=True)
        from fd.engine.core.outputs import ScheduledSeq, SchedulerOutput

        step = SchedulerOutput(
            step=1,
            seqs=(
                ScheduledSeq(
                    "s", tuple(ids[0]), 0, (1,), True, SamplingParams(temperature=0.0, lora="late"), 0
                ),
            ),
        )
        runner.submit(step)
        runner.unload_lora("late")
        runner.load_lora("again", mods["ad"])
        got = []
        deadline = time.monotonic() + 10
        while len(got) < 3 and time.monotonic() < deadline:
            got += runner.take_ready()
            time.sleep(0.01)
        assert got[0].step == 1 and got[1:] == [LoraDone("late", None), LoraDone("again", None)]
    finally:
        runner.close()
