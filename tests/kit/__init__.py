"""What the test modules share: helpers and fixtures, by topic. A test module imports from
here, never from another test module (tests/unit/test_layout.py checks it).

- ``redis``: the one launcher of real redis-server / redis-sentinel processes (no pytest, so
  bench/_common.py uses it too)
- ``cluster``, ``sentinel``: a Redis Cluster and a Sentinel deployment of a test's own
- ``tiny_model``, ``real_model``: session fixtures for the tiny model and the default one
- ``engine``, ``faults``: engine nodes in a test (gated runners, stories, kills, slices)
- ``api``: the API node against a fake tokenizer and a scripted fake engine
- ``scheduler``, ``journal``, ``model``, ``bus``: fakes and runs shared by those tests
- ``processes``: ``fd``'s commands as subprocesses
"""
