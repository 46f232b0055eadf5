"""The engine node: a sans-IO scheduler over a PaddlePaddle model, and its I/O shell.

- ``core``: the scheduler, its KV blocks and sequences, and what it trades with the runner;
- ``node``: the engine node, the I/O around the scheduler (claims, aborts, publishing, failover);
- ``runner``: the model runner, its worker process, sampling, and the stand-ins tests use;
- ``model``: the PaddlePaddle models and their checkpoints;
- ``journal``: the engine's journal and ``fd replay``.
"""
