"""DONE's ``saved`` field on the wire (docs/serve_protocol.md), and what the server makes of it.

The round trips under every chunking are tests/test_codec_mux.py's (its strategy draws ``saved``);
here: the exact bytes, an engine of the spec's eight fields (unknown, never guessed), a malformed
field, and the server's persistence status, which only a DONE that says "not saved" may degrade.
"""

from __future__ import annotations

import pytest

from colibri.api.engine_client import EngineClient, PersistStatus
from colibri.api.metrics import server_metrics
from colibri.io.events import Done, ErrorCode, ProtocolError
from colibri.io.mux import ResponseReader, encode_response

SPEC_DONE = b"DONE 4 STAT 10 12.34 56.7 1.23 42 1\n"  # the shared spec's eight fields


def done(saved: bool | None) -> Done:
    return Done(4, 10, 12.34, 56.7, 1.23, 42, True, saved)


@pytest.mark.parametrize(("saved", "line"), [
    (True, SPEC_DONE[:-1] + b" 1\n"),
    (False, SPEC_DONE[:-1] + b" 0\n"),
    (None, SPEC_DONE),  # nothing known: nothing claimed
])
def test_saved_is_the_ninth_field(saved, line):
    assert encode_response(done(saved)) == line
    assert ResponseReader().receive_data(line) == [done(saved)]


def test_an_eight_field_done_is_unknown_not_saved():
    assert ResponseReader().receive_data(SPEC_DONE)[0].saved is None


@pytest.mark.parametrize("field", [b"2", b"yes", b"", b"-1", b"01"])
def test_a_malformed_saved_field_is_a_bad_frame_and_the_stream_goes_on(field):
    out = ResponseReader().receive_data(SPEC_DONE[:-1] + b" " + field + b"\n" + SPEC_DONE)
    assert isinstance(out[0], ProtocolError) and out[0].code == ErrorCode.BAD_FRAME
    assert out[1:] == [done(None)]


def test_fields_after_saved_are_ignored():
    """Room for later trailing fields, as PERF has: a reader takes what it knows."""
    assert ResponseReader().receive_data(SPEC_DONE[:-1] + b" 0 7 x\n") == [done(False)]


# ------------------------------------------------------------------------------------ the server


def test_persist_status_degrades_on_a_failed_save_until_a_good_one():
    _, metrics = server_metrics()
    status = PersistStatus(enabled=True, on_failure=metrics.persist_failures.inc)
    status.note(done(True))
    assert not status.last_failed and status.failures == 0
    status.note(done(False))
    assert status.last_failed and status.failures == 1 and metrics.persist_failures.get() == 1
    status.note(done(None))  # an engine that does not say changes nothing
    assert status.last_failed
    status.note(done(True))
    assert not status.last_failed and status.failures == 1 and metrics.persist_failures.get() == 1


def test_persist_status_without_a_state_dir_never_fails():
    status = PersistStatus(enabled=False)
    status.note(done(False))
    assert not status.last_failed and status.failures == 0


@pytest.mark.parametrize(("args", "enabled"), [
    (["--state-dir", "/var/lib/colibri"], True),
    (["--no-persist"], False),
])
def test_engine_client_knows_whether_it_persists(args, enabled):
    assert EngineClient(["--model", "m.gguf", *args]).persist.enabled is enabled
