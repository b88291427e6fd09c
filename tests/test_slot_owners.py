"""A slot's cache is its owner's (issue 38, item 8): ``cache_slot`` is no prefix oracle between
clients. A request reuses a slot's history only when it carries the ``X-Session-Id`` of the
conversation the slot holds (or neither carries one); otherwise the engine forgets the slot first,
and ``reused_tokens`` is 0. The table of owners survives a restart, and a crash between a FORGET and
the end of the new owner's turn leaves the slot reusable by no one.

Unit tests on the table and admission; end to end on the real server and engine: a client guessing
another's 4-digit PIN learnt 17 vs 13 reused tokens for a right and a wrong guess before.
"""

from __future__ import annotations

import json
import os

import pytest
from serve_harness import running_server

from colibri.api.admission import Admission
from colibri.api.slot_owners import ANONYMOUS, OWNERS_FILE, UNKNOWN, SlotOwners, owner_of
from colibri.io.events import Forget
from colibri.io.mux import RequestReader, encode_request

A, B = owner_of("alice-session"), owner_of("bob-session")


def test_forget_is_a_mux_line():
    assert encode_request(Forget(3)) == b"FORGET 3\n"
    assert RequestReader().receive_data(b"FORGET 3\n") == [Forget(3)]
    for bad in (b"FORGET\n", b"FORGET 256\n", b"FORGET -1\n", b"FORGET 1 2\n"):
        assert RequestReader().receive_data(bad)[0].detail == "FORGET takes a slot number"


def test_an_owner_is_a_hash_of_the_session_id():
    assert owner_of(None) == owner_of("") == ANONYMOUS
    assert A != B and "alice" not in A and len(A) == 64


async def test_claim_and_settle_without_persistence():
    owners = SlotOwners(2, None)
    assert not await owners.claim(0, ANONYMOUS)  # empty slots: anyone's
    assert await owners.claim(0, A)  # alice takes an anonymous slot: forgotten first
    await owners.settle(0, A, saved=None)
    assert owners.reusable(0, A) and not owners.reusable(0, B) and not owners.reusable(0, ANONYMOUS)
    assert not await owners.claim(0, A)  # her next turn keeps her cache
    assert await owners.claim(0, B)


async def test_the_owner_is_known_only_once_the_new_content_is_on_disk(tmp_path):
    owners = SlotOwners(2, tmp_path)
    assert owners.tags == [UNKNOWN, UNKNOWN]  # no table yet: nobody's for sure
    assert await owners.claim(1, A)
    await owners.settle(1, A, saved=False)  # the turn's file was not written: the old may be there
    assert owners.tags[1] == UNKNOWN
    assert SlotOwners(2, tmp_path).tags == [UNKNOWN, UNKNOWN]
    assert await owners.claim(1, A)
    await owners.settle(1, A, saved=True)
    assert SlotOwners(2, tmp_path).tags == [UNKNOWN, A]  # what a restarted server reads
    assert await owners.claim(1, B)  # bob: UNKNOWN on disk before the FORGET goes out
    assert SlotOwners(2, tmp_path).tags == [UNKNOWN, UNKNOWN]


def test_a_bad_or_linked_table_is_nobody(tmp_path):
    (tmp_path / OWNERS_FILE).write_text("{not json")
    assert SlotOwners(2, tmp_path).tags == [UNKNOWN, UNKNOWN]
    (tmp_path / OWNERS_FILE).unlink()
    (tmp_path / "elsewhere").write_text(json.dumps([A, A]))
    os.symlink(tmp_path / "elsewhere", tmp_path / OWNERS_FILE)
    assert SlotOwners(2, tmp_path).tags == [UNKNOWN, UNKNOWN]


async def test_admission_chooses_by_prefix_only_among_the_owners_slots():
    owners = SlotOwners(2, None)
    admission = Admission(2, 4, 5.0, owners=owners)
    prompt = tuple(range(40))
    lease = await admission.lease(None, prompt, A)
    assert await owners.claim(lease.slot, A)
    await owners.settle(lease.slot, A, None)
    await lease.release()
    held = lease.slot
    theirs = await admission.lease(None, prompt + (99,), B)  # bob's prompt continues alice's
    assert theirs.slot != held and not theirs.prefix_hit
    await theirs.release()
    mine = await admission.lease(None, prompt + (99,), A)
    assert mine.slot == held and mine.prefix_hit
    await mine.release()


PIN_TEXT = "My bank PIN is {pin}. Never tell anyone."


def _turn(srv, content: str, session: str | None, slot: int = 0) -> int:
    headers = {"X-Session-Id": session} if session else {}
    r = srv.http().post("/v1/chat/completions", headers=headers, json={
        "model": "m", "max_tokens": 2, "temperature": 0, "cache_slot": slot,
        "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    return r.json()["colibri"]["reused_tokens"]


@pytest.mark.parametrize("persist", [False, True], ids=["memory", "state-dir"])
def test_pinning_anothers_slot_learns_nothing(tmp_path, persist):
    args = ["--kv-slots", "2", "--ctx", "1024"]
    if persist:
        state = tmp_path / "state"
        state.mkdir(mode=0o700)
        args += ["--state-dir", str(state)]
    with running_server(*args) as srv:
        _turn(srv, PIN_TEXT.format(pin=4821), "alice-session")  # alice's conversation, slot 0
        assert _turn(srv, PIN_TEXT.format(pin=4821), "alice-session") > 10  # her cache is hers
        right = _turn(srv, PIN_TEXT.format(pin=4821), "mallory-session")  # a right guess
        assert right == 0
        _turn(srv, PIN_TEXT.format(pin=4821), "alice-session")  # alice refills her slot
        wrong = _turn(srv, PIN_TEXT.format(pin=1111), None)  # no session id: not hers either
        assert wrong == 0
        # anonymous clients share among themselves (docs/deploy.md): the slot is theirs now
        assert _turn(srv, PIN_TEXT.format(pin=1111), None) > 10
        _turn(srv, PIN_TEXT.format(pin=4821), "alice-session")
    if persist:  # restarted, the table read back: alice's slot is still hers, and only hers
        with running_server(*args) as srv:
            assert _turn(srv, PIN_TEXT.format(pin=4821), "alice-session") > 10
            assert _turn(srv, PIN_TEXT.format(pin=4821), "mallory-session") == 0


def test_forgetting_is_ordered_before_the_submit():
    """The server writes FORGET and SUBMIT in one write: the engine reads them in that order."""
    events = RequestReader().receive_data(encode_request(Forget(1)) + b"SUBMIT 5 1 2 4 0.0 1.0\nhi\n")
    assert events[0] == Forget(1) and events[1].slot == 1


