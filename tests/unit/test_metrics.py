"""fd/control/metrics.py: what a scrape reads is current after every update, whichever metrics
moved, and is the text prometheus_client renders for the same updates."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from fd.control.metrics import _LATENCY_BUCKETS, Metrics


def test_each_update_shows_in_the_next_render():
    m = Metrics()
    first = m.render()
    assert m.render() == first
    m.inter_token_latency_seconds.observe(0.02)
    assert b"fd_inter_token_latency_seconds_count 1.0" in m.render()
    m.requests_total.labels("stop").inc()
    m.requests_total.labels("abort").inc(3)
    text = m.render()
    assert b'fd_requests_total{finish_reason="stop"} 1.0' in text
    assert b'fd_requests_total{finish_reason="abort"} 3.0' in text
    m.num_requests_running.set(4)
    assert b"fd_num_requests_running 4.0" in m.render()
    m.num_requests_running.set(4)  # the same value again: nothing to render anew
    m.num_requests_running.set(0)
    assert b"fd_num_requests_running 0.0" in m.render()
    m.dead_letters_total.inc()
    assert b"fd_dead_letters_total 1.0" in m.render()
    m.note_placement("hit", 0.0002)
    m.note_placement("none", 0.0001)
    text = m.render()
    assert b'fd_placements_total{result="hit"} 1.0' in text and b"fd_placement_seconds_count 2.0" in text


def test_the_text_is_prometheus_clients_for_the_same_updates():
    m = Metrics()
    r = CollectorRegistry(auto_describe=True)
    itl = Histogram("fd_inter_token_latency_seconds", "x", buckets=_LATENCY_BUCKETS, registry=r)
    reqs = Counter("fd_requests_total", "x", ["finish_reason"], registry=r)
    running = Gauge("fd_num_requests_running", "x", registry=r)
    for v in (0.001, 0.03, 0.2):
        m.inter_token_latency_seconds.observe(v)
        itl.observe(v)
    m.requests_total.labels("length").inc()
    reqs.labels("length").inc()
    m.num_requests_running.set(2)
    running.set(2)

    def samples(text: bytes) -> set[bytes]:  # (less the *_created timestamps, which differ)
        return {ln for ln in text.splitlines() if not ln.startswith(b"#") and b"_created" not in ln}

    ours, theirs = samples(m.render()), samples(generate_latest(r))
    assert theirs <= ours
