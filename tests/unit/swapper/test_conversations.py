"""Every conversation keeps its prompt cache across swaps (issue 33), on the fake
runtime and a fake one-slot llama-server with a RAM prompt cache (FakeSlotServer:
a prompt continues the slot, else the slot goes to RAM and the best RAM entry
comes back): the conversation key (swapper/conversations.py), the saves before a
stop (the slot's own conversation as it is, each other one replayed for one token
first), the restore of all of them at the next load (each but the last moved on
to the RAM cache), the bounds, and the swap ledger (swapper/swaps.py)."""
import json

import orjson
import pytest
import requests

from swapper.conversations import Book, conversation_of, replay_body
from swapper.swaps import Ledger
from tests.support.fake_runtime import FakeSlotServer
from tests.support.kvcache import files, make, sample, spec, turn
from tests.support.clock import Clock

ARGS1 = ("-m", "/models/m.gguf", "-c", "8192", "-t", "1")
SYSTEM = "You are a coding agent. " * 20


def chat(*turns, system=SYSTEM, tools=None):
    messages = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    body = {"model": "a", "messages": messages, "max_tokens": 4, "stream": True}
    if tools:
        body["tools"] = tools
    return body


def key(body, route="chat/completions"):
    conv = conversation_of(route, "v1/" + route, body, orjson.dumps(body))
    return conv.key if conv else None


# ------------------------------------------------------------------ the key
def test_a_next_turn_keeps_its_key_and_a_side_call_has_its_own():
    first = chat("Fix the bug in parser.py")
    nxt = chat("Fix the bug in parser.py", "Done: see the diff.", "Now add a test.")
    side = chat("Fix the bug in parser.py", system="Write a 5-word title for this.")
    other = chat("Explain main.py")
    assert key(first) == key(nxt)
    assert len({key(first), key(side), key(other)}) == 3


def test_two_sessions_in_one_folder_differ_by_their_first_prompt():
    """Codex's first turn: its permissions (developer), its environment (user),
    then the prompt; later turns append answers, calls and their results."""
    def codex(prompt, *after):
        return {"model": "a", "instructions": "You are Codex.", "input": [
            {"type": "message", "role": "developer", "content": "sandbox: on"},
            {"type": "message", "role": "user", "content": "<environment_context>"
             "<cwd>/src</cwd></environment_context>"},
            {"type": "message", "role": "user", "content": prompt}, *after]}
    call = [{"type": "function_call", "name": "exec", "call_id": "c1", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            {"type": "message", "role": "user", "content": "and now?"}]
    one, two = codex("Fix the parser."), codex("Write the docs.")
    assert key(one, "responses") != key(two, "responses")
    assert key(one, "responses") == key(codex("Fix the parser.", *call), "responses")


def test_the_key_reads_each_dialects_head_and_ignores_cache_control():
    msgs = {"model": "a", "system": [{"type": "text", "text": "S"}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    marked = json.loads(json.dumps(msgs))
    marked["messages"][0]["content"][0]["cache_control"] = {"type": "ephemeral"}
    marked["system"][0]["cache_control"] = {"type": "ephemeral"}
    assert key(msgs, "messages") == key(marked, "messages")
    other_system = dict(msgs, system="T")
    assert key(msgs, "messages") != key(other_system, "messages")
    assert key({"model": "a", "input": "hi", "instructions": "I"}, "responses") != \
        key({"model": "a", "input": "hi", "instructions": "J"}, "responses")
    # Responses' developer items lead the conversation like system messages
    dev = [{"role": "developer", "content": "D"}, {"role": "user", "content": "go"}]
    assert key({"model": "a", "input": dev}, "responses") == \
        key({"model": "a", "input": dev + [{"role": "assistant", "content": "x"}]},
            "responses")
    assert key({"model": "a", "prompt": "def f():"}, "completions") is not None
    assert key({"model": "a", "messages": []}) is None
    assert conversation_of("embeddings", "v1/embeddings", {"input": "x"}, b"") is None
    assert conversation_of("messages/count_tokens", "v1/messages/count_tokens", msgs,
                           b"") is None


def test_a_replay_asks_one_token_not_streamed():
    body = chat("hi")
    body.update(max_completion_tokens=900, stream_options={"include_usage": True},
                return_progress=True, n=3)
    conv = conversation_of("chat/completions", "v1/chat/completions", body,
                           orjson.dumps(body))
    replay = orjson.loads(replay_body(conv))
    assert replay["max_tokens"] == 1 and "stream" not in replay and "n" not in replay
    assert "max_completion_tokens" not in replay and "return_progress" not in replay
    assert replay["messages"] == body["messages"]
    resp = {"model": "a", "input": "hi", "max_output_tokens": 500, "stream": True}
    conv = conversation_of("responses", "v1/responses", resp, orjson.dumps(resp))
    assert orjson.loads(replay_body(conv))["max_output_tokens"] == 1
    huge = conversation_of("chat/completions", "v1/chat/completions", body,
                           b"x" * (5 << 20))
    assert huge.body is None and replay_body(huge) is None


def test_the_book_is_bounded_and_keeps_the_newest():
    book = Book(limit=3)
    convs = [conversation_of("chat/completions", "v1/chat/completions", chat(f"task {i}"),
                             b"{}") for i in range(10)]
    for c in convs:
        book.served("a", c)
    book.served("a", convs[7])                    # served again: the newest
    stint = book.take("a")
    assert [c.key for c, _ in stint.conversations] == [convs[i].key for i in (8, 9, 7)]
    assert stint.last.key == convs[7].key
    assert book.take("a") is None


# ------------------------------------------------------- save and restore
@pytest.fixture
def one(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with FakeSlotServer(tmp_path / "a", slots=1) as a, FakeSlotServer(tmp_path / "b",
                                                                       slots=1) as b:
        models = {"a": spec("a", args=ARGS1, slots=1), "b": spec("b", args=ARGS1, slots=1)}
        w = make(tmp_path, {"a": a, "b": b}, models=models)
        w.servers = {"a": a, "b": b}
        yield w


def talk(w, model, body):
    """One request as the forwarder sends it: admitted (loading or swapping to
    `model`), its conversation told to the keeper, answered: its timings."""
    t = w.sched.submit(model)
    turn(w, 4)
    assert t.state == "admitted", t.error
    conv = conversation_of("chat/completions", "v1/chat/completions", body, orjson.dumps(body))
    w.driver.kv.served(model, conv)
    r = requests.post(w.servers[model].url + "/v1/chat/completions", json=body, timeout=10)
    w.sched.release(t)
    tail = r.content
    if w.driver.kv.awaits_answer(model, conv.key):
        w.driver.kv.answered(model, tail, conv.key)
    return r.json()["timings"]


A1 = chat("Task A: " + "a" * 3000)
A2 = chat("Task A: " + "a" * 3000, "ok", "more A")
C1 = chat("Task C: " + "c" * 3000)
C2 = chat("Task C: " + "c" * 3000, "ok", "more C")
SIDE = chat("Task A: " + "a" * 3000, system="Title this in five words.")


def processed_share(t):
    return t["prompt_n"] / (t["prompt_n"] + t["cache_n"])


@pytest.mark.parametrize("order", [("A", "C"), ("C", "A")])
def test_two_conversations_both_keep_their_cache_across_a_swap_in_any_order(one, order):
    talk(one, "a", A1)
    talk(one, "a", C1)                       # C is the slot's, A in the RAM cache
    talk(one, "b", chat("hi"))               # the swap: both saved
    folder = one.root / "a"
    names = [n for n in files(folder) if n.endswith(".json")]
    assert len(names) == 2, names
    replays = [b for p, b in one.servers["a"].answered if b.get("max_tokens") == 1]
    assert len(replays) == 1 and replays[0]["messages"] == A1["messages"]
    assert "stream" not in replays[0]
    one.servers["a"].texts.clear()
    one.servers["a"].ram.clear()             # a new backend process
    second = {"A": A2, "C": C2}
    for name in order:
        t = talk(one, "a", second[name])
        assert processed_share(t) <= 0.05, (name, t)
    saved = [f for e, f in one.events if e == "saving" and f.get("done")]
    assert saved[0]["tokens"] > 6000 and saved[0]["replayed_tokens"] <= 2
    reused = [f for e, f in one.events if e == "reused"]
    assert sorted(r["conversation"] for r in reused) == sorted(
        [key(A2), key(C2)])
    assert all(r["processed"] <= 0.05 * (r["processed"] + r["reused"]) for r in reused)


def test_a_side_call_last_before_the_swap_keeps_the_main_conversation(one):
    talk(one, "a", A1)
    talk(one, "a", SIDE)                      # a title call in A's session, last
    talk(one, "b", chat("hi"))
    kept = one.driver.kv.kept()               # what /running and the console show
    assert kept["models"]["a"]["prompts"] == 2 and kept["conversations_per_model"] == 8
    assert kept["bytes"] == sum(p.stat().st_size for p in (one.root / "a").iterdir())
    one.servers["a"].texts.clear()
    one.servers["a"].ram.clear()
    t = talk(one, "a", A2)
    assert processed_share(t) <= 0.05, t


def test_only_conversations_of_the_stint_are_saved_again(one):
    talk(one, "a", A1)
    talk(one, "b", chat("hi"))                # A saved
    talk(one, "a", C1)                        # back: A restored; only C served
    calls = len(one.servers["a"].calls)
    talk(one, "b", chat("hi again"))
    saves = [c for c in one.servers["a"].calls[calls:] if c[0] == "save"]
    assert len(saves) == 1                    # C's; A's file was already its latest
    assert len([n for n in files(one.root / "a") if n.endswith(".bin")]) == 2


def test_bounded_by_count_and_by_the_save_budget(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with FakeSlotServer(tmp_path / "a", slots=1) as a, FakeSlotServer(tmp_path / "b",
                                                                       slots=1) as b:
        models = {"a": spec("a", args=ARGS1, slots=1), "b": spec("b", args=ARGS1, slots=1)}
        w = make(tmp_path, {"a": a, "b": b}, models=models, KV_CACHE_CONVERSATIONS=3)
        w.servers = {"a": a, "b": b}
        for i in range(6):                     # six conversations, one stint
            talk(w, "a", chat(f"task {i} " * 30))
        talk(w, "b", chat("hi"))
        assert len([n for n in files(tmp_path / "a") if n.endswith(".bin")]) == 3
        for i in range(6, 9):                  # three more in the next stint
            talk(w, "a", chat(f"task {i} " * 30))
        talk(w, "b", chat("hi"))
        assert len([n for n in files(tmp_path / "a") if n.endswith(".bin")]) == 3
        restores = [c for c in a.calls if c[0] == "restore"]
        assert len(restores) == 3              # never more than kept


def test_a_refused_replay_costs_that_conversation_only(one):
    talk(one, "a", A1)
    talk(one, "a", C1)
    one.servers["a"].completion_status = 500
    talk(one, "b", chat("hi"))
    names = [n for n in files(one.root / "a") if n.endswith(".json")]
    assert names == [f"conv-{key(C1)}.json"]
    assert sample(one.metrics.collectors, "swapper_kv_cache_failures_total",
                  direction="save", reason="replay") == 1


def test_without_a_ram_cache_only_the_newest_is_restored(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    args = ARGS1 + ("--cache-ram", "0")
    with FakeSlotServer(tmp_path / "a", slots=1) as a, FakeSlotServer(tmp_path / "b",
                                                                       slots=1) as b:
        models = {"a": spec("a", args=args, slots=1), "b": spec("b", args=ARGS1, slots=1)}
        w = make(tmp_path, {"a": a, "b": b}, models=models)
        w.servers = {"a": a, "b": b}
        talk(w, "a", A1)
        talk(w, "a", C1)
        talk(w, "b", chat("hi"))
        calls = len(a.calls)
        talk(w, "a", C2)
        assert [c[0] for c in a.calls[calls:]] == ["restore"]
        assert not any(p == "/completion" for p, _ in a.answered)


def test_a_restore_moves_all_but_the_last_to_the_ram_cache(one):
    talk(one, "a", A1)
    talk(one, "a", C1)
    talk(one, "b", chat("hi"))
    one.servers["a"].texts.clear()
    one.servers["a"].ram.clear()
    t = one.sched.submit("a")
    turn(one, 4)
    assert t.state == "admitted"
    stashes = [b for p, b in one.servers["a"].answered if p == "/completion"]
    assert len(stashes) == 1 and stashes[0]["n_predict"] == 1
    assert len(one.servers["a"].ram) == 1                  # A went to RAM, C is the slot's
    one.sched.release(t)


# ------------------------------------------------------------- the ledger
def test_the_ledger_prices_each_phase_and_the_serving_share():
    clock, events = Clock(), []
    ledger = Ledger(emit=lambda e, **f: events.append((e, f)), clock=clock, wall=clock)
    ledger.in_flight(1)
    clock.now += 60                          # a minute answering
    ledger.in_flight(0)
    ledger.stopped("a", "swap", stop=3.0, save=2.0)
    ledger.loaded("b", start=1.0, healthy=10.0, restore=1.0)
    ledger.in_flight(1)
    clock.now += 20
    ledger.reprefilled("b", 3000, 8.0)       # 8 of those 20 s re-prefilled
    ledger.in_flight(0)
    (swap,) = [f for e, f in events if e == "swap"]
    assert swap["from"] == "a" and swap["to"] == "b"
    assert swap["phases"] == {"stop": 1.0, "save": 2.0, "start": 1.0, "healthy": 10.0,
                              "restore": 1.0}
    status = ledger.status()
    assert status["last_swap"]["reprefill"] == {"requests": 1, "tokens": 3000, "seconds": 8.0}
    hour = status["last_hour"]
    assert hour["busy_seconds"] == 80 and hour["swap_seconds"] == 15
    assert hour["serving_share"] == pytest.approx(72 / 95, abs=1e-3)
    clock.now += 4000                        # an hour later: nothing counted
    assert ledger.last_hour()["serving_share"] is None


def test_replays_stop_once_the_ram_cache_no_longer_held_one(one):
    for body in (A1, C1, chat("Task E: " + "e" * 3000)):
        talk(one, "a", body)
    one.servers["a"].ram.clear()              # llama-server evicted A and C meanwhile
    talk(one, "b", chat("hi"))
    replays = [b for p, b in one.servers["a"].answered if b.get("max_tokens") == 1]
    assert len(replays) == 1                  # C's (a re-prefill): A is not tried after it
    names = [n for n in files(one.root / "a") if n.endswith(".json")]
    assert len(names) == 1                    # E, the slot's own
    assert sample(one.metrics.collectors, "swapper_kv_cache_failures_total",
                  direction="save", reason="evicted") == 1
