"""fd/tools/gauge_sampler.py, the gauge poller of the release benchmarks and ``fd bench``: it
samples a server's running + waiting sum on the caller's clock from a process of its own, and
reads fd's and vLLM's exposition alike."""

from __future__ import annotations

import http.server
import threading
import time

from bench._common import FD_GAUGES
from fd.tools.gauge_sampler import GaugeSampler, parse

VLLM = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def test_parse_sums_the_named_gauges_labelled_or_not():
    fd = b"# HELP fd_num_requests_running x\nfd_num_requests_running 3.0\nfd_num_requests_waiting 2.0\nfd_kv_blocks_free 9.0\n"
    assert parse(fd, FD_GAUGES) == 5.0
    vllm = (
        b'vllm:num_requests_running{engine="0",model_name="smol"} 4.0\n'
        b'vllm:num_requests_waiting{engine="0",model_name="smol"} 1.0\n'
        b'vllm:num_requests_running_total{model_name="smol"} 7.0\n'
    )
    assert parse(vllm, VLLM) == 5.0
    # by suffix (fd bench, which knows no server's prefix): the same sums, on either
    suffixes = ("num_requests_running", "num_requests_waiting")
    assert parse(vllm, suffixes, suffix=True) == 5.0 and parse(fd, suffixes, suffix=True) == 5.0


class _Metrics(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # (kept alive, as the sampler's connection is)
    disable_nagle_algorithm = True  # (its header and body go in two writes)
    running = 3

    def do_GET(self):
        body = f"fd_num_requests_running {type(self).running}\nfd_num_requests_waiting 0\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_samples_follow_the_server_on_the_callers_clock():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        sampler = GaugeSampler(f"http://127.0.0.1:{server.server_address[1]}", FD_GAUGES, period_s=0.005)
        sampler.start()
        time.sleep(0.15)
        changed = time.perf_counter()
        _Metrics.running = 1
        time.sleep(0.15)
        samples = sampler.stop()
    finally:
        server.shutdown()
        _Metrics.running = 3
    # a sample's time is when its answer was in; its request went after the sample before it
    before = [v for t, v in samples if t < changed]
    after = [v for (sent_after, _), (_, v) in zip(samples, samples[1:]) if sent_after > changed]
    assert before and set(before) == {3.0}
    assert after and set(after) == {1.0}
    # every 5 ms or so: the 0.3 s it ran holds tens of samples, not a handful
    assert len(samples) >= 15
