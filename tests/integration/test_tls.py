"""HTTPS as vLLM serves it: ``--ssl-certfile``/``--ssl-keyfile`` (and client certificates with
``--ssl-ca-certs``/``--ssl-cert-reqs``) make the API node speak TLS; a bad file is a one-line
error before the model loads."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time

import httpx
import openai
import pytest

from fd.api.config import ApiConfig
from fd.compose import join_in_process, start_api, start_engine
from fd.control.metrics import Metrics
from fd.engine.node.node_config import EngineConfig


@pytest.fixture(scope="module")
def cert(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and its key, by openssl (Debian's, as CI has)."""
    d = tmp_path_factory.mktemp("tls")
    key, crt = str(d / "key.pem"), str(d / "cert.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout", key,
         "-out", crt, "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return crt, key


async def test_the_api_speaks_https_with_vllms_flags(embedded_redis, keys, tiny_model_dir, tiny_runner, cert):
    crt, key = cert
    metrics = Metrics()
    eng = await start_engine(
        embedded_redis.client,
        keys,
        EngineConfig(model_dir=str(tiny_model_dir), engine_id="e-tls"),
        runner=tiny_runner,
        metrics=metrics,
    )
    api = await start_api(
        embedded_redis.client,
        keys,
        ApiConfig(model_dir=str(tiny_model_dir), ssl_certfile=crt, ssl_keyfile=key),
        metrics=metrics,
    )
    join_in_process(api, eng)
    try:
        assert api.url.startswith("https://")
        trusted = ssl.create_default_context(cafile=crt)
        async with httpx.AsyncClient(verify=trusted) as http:
            client = openai.AsyncOpenAI(
                base_url=f"{api.url}/v1", api_key="none", max_retries=0, http_client=http
            )
            c = await client.chat.completions.create(
                model=api.cfg.model_name,
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=4,
                extra_body={"ignore_eos": True},
            )
            assert c.usage.completion_tokens == 4
        # a client that does not trust the certificate is refused by its own TLS check
        async with httpx.AsyncClient() as http:
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await http.get(f"{api.url}/health")
        # and plain HTTP on the port gets no answer
        async with httpx.AsyncClient() as http:
            with pytest.raises(httpx.HTTPError):
                await http.get(api.url.replace("https://", "http://") + "/health")
    finally:
        await api.stop()
        await eng.stop()


def test_client_certificates_as_vllms_ssl_cert_reqs(cert):
    crt, key = cert
    ctx = ApiConfig(
        model_dir="", ssl_certfile=crt, ssl_keyfile=key, ssl_ca_certs=crt, ssl_cert_reqs=2
    ).ssl_context()
    assert ctx is not None and ctx.verify_mode == ssl.CERT_REQUIRED
    assert ApiConfig(model_dir="").ssl_context() is None
    with pytest.raises(ValueError, match="need --ssl-certfile"):
        ApiConfig(model_dir="", ssl_keyfile=key).ssl_context()


def test_a_missing_certificate_is_one_line_before_the_model_loads(tmp_path):
    env = {**os.environ, "FD_CACHE_DIR": str(tmp_path / "cache"), "FD_RUNTIME_DIR": str(tmp_path / "run")}
    env.pop("FD_REDIS_URL", None)
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "fd", "serve", "--model", "tiny", "--port", "0", "--ssl-certfile",
         str(tmp_path / "missing.pem")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )  # fmt: skip
    assert r.returncode == 1 and time.monotonic() - t0 < 10
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and "--ssl-certfile" in lines[0], lines
    assert not (tmp_path / "cache").exists()  # (the tiny model, made on first use, never was)
