"""The embedded store's direct path runs on the fakeredis releases it was verified on only
(fd/control/embedded_store.py): it reaches into fakeredis's objects, which a release may change."""

from __future__ import annotations

import logging

from fd.control.embedded_store import VERIFIED_FAKEREDIS, direct_verified, fakeredis_version


def test_the_installed_fakeredis_is_a_release_the_direct_path_was_verified_on():
    """Fails on a fakeredis upgrade, on purpose. Before adding the release to
    ``VERIFIED_FAKEREDIS``: run tests/integration/test_embedded_fast_path.py (the direct path's
    replies and data against the commands') and the store contract
    (tests/integration/test_store_contract.py) on it, and fix or drop what differs. Left out,
    ``fd serve`` still works on it, through the commands, and slower (bench/README.md,
    2026-12-07)."""
    installed = fakeredis_version()
    assert installed in VERIFIED_FAKEREDIS, (
        f"fakeredis {installed} is installed; the embedded store's direct path was verified on "
        f"{sorted(VERIFIED_FAKEREDIS)} only: verify it on {installed} (see this test's docstring)"
    )
    assert direct_verified()


def test_another_release_gets_the_commands_with_one_log_line(caplog):
    with caplog.at_level(logging.WARNING, logger="fd.control.embedded"):
        assert not direct_verified("99.0.0")
    assert [r.getMessage() for r in caplog.records] == [
        "embedded store: fakeredis 99.0.0 is not a release its direct path was verified on "
        f"({', '.join(sorted(VERIFIED_FAKEREDIS))}): every operation goes through fakeredis's "
        "commands (slower)"
    ]
