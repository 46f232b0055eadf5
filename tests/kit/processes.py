"""``fd``'s commands as an operator runs them: subprocesses in their own session, stopped by
pid (the whole group killed if they do not stop), and a wait until one answers /health."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp

PY = sys.executable


def spawn_fd(*args: str, env=None) -> subprocess.Popen:
    return subprocess.Popen(
        [PY, "-m", "fd", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def stop_fd(proc: subprocess.Popen, sig=signal.SIGTERM) -> tuple[int, str]:
    if proc.poll() is None:
        os.kill(proc.pid, sig)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    return proc.returncode, out


async def wait_healthy(url: str, procs, timeout=60.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            for p in procs:
                if p.poll() is not None:
                    raise AssertionError(f"process exited early:\n{p.stdout.read()}")
            try:
                async with http.get(f"{url}/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise AssertionError("never healthy")
