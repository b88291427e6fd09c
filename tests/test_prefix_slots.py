"""Prefix-aware slot choice, end to end: two conversations through four slots, several turns each,
other traffic in between and alongside; every later turn lands in its conversation's slot and
prefills only what is new (the engine's ``reused_tokens``), and /metrics counts it.

The real server and engine (the session's shared server: 4 slots) and the official SDK, no
``cache_slot`` anywhere: the server alone must find the slot. Under the least-recently-used choice
alone the second turns would land in other slots (each request moves its slot to the back) and
reuse only the template's preamble.
"""

from __future__ import annotations

import re
import threading

from serve_harness import error_body, user

from colibri.api.admission import common_prefix

TURNS = 3
MAX_TOKENS = 6  # short answers: the test is about prompts, not generation
CONVERSATIONS = {
    "a": ["Name one colour of the sea, in a few words.", "Why is that so?", "And at night?"],
    "b": ["Name one animal of the forest, in a few words.", "What does it eat?", "Where does it sleep?"],
}
# Other users: new conversations with the same (default) system prompt, a sentence or two each, one
# streamed alongside each turn of conversation "a". They share only the template's preamble with
# any slot, so they take the least recently used free slot (never a conversation's here: both move
# their slot to the back at each turn); under the least-recently-used choice alone, "a"'s next turn
# would take the slot neither conversation nor the other user used last.
OTHERS = ["Tell me a fact about the moon, briefly, and why it matters to the tides.",
          "Describe rain falling on a quiet city street, in a short line or two.",
          "Give a word that rhymes with cat, and use it in a sentence about a hat.",
          "Say something about mountains and the people who climb them in winter.",
          "What is a library for, and who goes there on a rainy afternoon?",
          "Describe a thunderstorm over the plains, as a farmer would see it."]


def _metric(http, name: str) -> float:
    text = http.get("/metrics").text
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m[1])


def _ask(client, model: str, messages: list[dict]) -> dict:
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                            temperature=0)
    extra = answer.model_extra["colibri"]
    return {"text": answer.choices[0].message.content, "slot": extra["slot"],
            "reused": extra["reused_tokens"], "prefilled": extra["perf"]["prefilled_tokens"],
            "prompt": answer.usage.prompt_tokens}


def _stream_alongside(server, text: str, done: list) -> tuple[threading.Thread, threading.Event]:
    """Another user's streamed request; the event is set at its first token, so the turn sent then
    is admitted while it holds a slot and is decoded in the same batch."""
    started = threading.Event()

    def run() -> None:
        with server.client() as c:
            stream = c.chat.completions.create(model=server.model_id, messages=user(text), max_tokens=24,
                                               temperature=0, stream=True)
            n = 0
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    n += 1
                    started.set()
            done.append(n)
            started.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, started


def test_turns_return_to_their_slot_and_reuse_their_prefix(server, client, http):
    hits0 = _metric(http, "colibri_prefix_hits_total")
    reused0 = _metric(http, "colibri_reused_tokens_total")
    history: dict[str, list[dict]] = {k: [] for k in CONVERSATIONS}
    first: dict[str, dict] = {}
    last: dict[str, dict] = {}
    others = iter(OTHERS)
    later_reused = 0
    for turn in range(TURNS):
        for name, questions in CONVERSATIONS.items():
            alongside: list[int] = []
            if name == "a":
                thread, started = _stream_alongside(server, next(others), alongside)
                assert started.wait(120)
            history[name].append({"role": "user", "content": questions[turn]})
            got = _ask(client, server.model_id, history[name])
            if name == "a":
                thread.join(120)
                assert alongside and alongside[0] > 0  # the other user was answered too
            history[name].append({"role": "assistant", "content": got["text"]})
            if turn == 0:
                first[name] = got
            else:
                prev = last[name]
                assert got["slot"] == first[name]["slot"], (name, turn, got, first[name])
                # the whole previous prompt came from the KV cache: only the new turn was prefilled
                assert prev["prompt"] <= got["reused"] < got["prompt"], (name, turn, got, prev)
                assert got["prefilled"] == got["prompt"] - got["reused"]
                later_reused += got["reused"]
            last[name] = got
    assert first["a"]["slot"] != first["b"]["slot"]
    later_turns = (TURNS - 1) * len(CONVERSATIONS)
    assert _metric(http, "colibri_prefix_hits_total") - hits0 >= later_turns
    assert _metric(http, "colibri_reused_tokens_total") - reused0 >= later_reused


def test_common_prefix_is_exact():
    assert common_prefix((1, 2, 3, 4), (1, 2, 3, 9, 9)) == 3
    assert common_prefix((1, 2, 3), (1, 2, 3, 4)) == 3
    assert common_prefix((5,), (1,)) == 0
    assert common_prefix("abcx", "abcy") == 3
    assert common_prefix("123", (1, 2, 3)) == 0  # text and ids never match
    for n in range(0, 70):  # every split point of the bisection
        a = tuple(range(70))
        b = a[:n] + (-1,) + a[n + 1:]
        assert common_prefix(a, b) == n


def test_replica_names_itself_and_session_ids_are_checked(server, http):
    replica = server.base_url.removeprefix("http://")  # the default --replica-id: the bound host:port
    health = http.get("/health")
    assert health.headers["x-colibri-replica"] == replica and health.json()["replica"] == replica
    ok = http.get("/v1/models", headers={"X-Session-Id": "team-a:user_7@conv.1"})
    assert ok.status_code == 200 and ok.headers["x-colibri-replica"] == replica
    for bad in ("a" * 129, "x y", "a;b", "${host}", "é"):
        refused = http.get("/v1/models", headers={"X-Session-Id": bad.encode()})
        err = error_body(refused)
        assert refused.status_code == 400 and err["code"] == "invalid_session_id", bad
        assert err["param"] == "X-Session-Id" and bad not in err["message"]
