"""common/sse.py's events as the proxy's stages see them: what a comment says, a
blank event, the events the stages make (keep-alive, [DONE]) written as the
wire has them."""
from common import sse


def test_a_comment_events_words_and_a_blank_event():
    ev = sse.parse_event(b": loading model m (3 s)\n: ~10 s left\n\n")
    blank, data = sse.Event(b"\n\n", None), sse.parse_event(b"data: {}\n\n")
    assert ev.words == "loading model m (3 s) ~10 s left" and not ev.blank
    assert blank.words == "" and blank.blank and blank.is_comment
    assert data.words == "" and not data.blank and not data.is_comment
    assert sse.parse_event(b":\n\n").words == "" and not sse.parse_event(b":\n\n").blank
    # glued to the blank lines a read brought before it, a comment keeps its words
    (glued,) = sse.batch(b"\n\n: keep-alive\n\n")
    assert glued.words == "keep-alive" and glued.raw == b"\n\n: keep-alive\n\n"


def test_the_events_a_stage_makes_are_written_as_the_wire_has_them():
    (ka,), done = sse.keepalive(), sse.done()
    assert ka.is_comment and ka.words == "keep-alive" and not ka.blank
    assert done.is_done and done.json is None
    assert sse.keepalive()[0] is not ka              # each its own
    assert b"".join(sse.write([[ka], [done]])) == sse.KEEPALIVE + sse.DONE
    assert [(e.raw, e.data) for e in sse.events(sse.KEEPALIVE + sse.DONE)] == \
        [(ka.raw, ka.data), (done.raw, done.data)]


def test_bare_is_the_event_without_the_blank_lines_glued_to_it_however_cut():
    """The reader glues blank lines to a neighbour, the one before or after as the
    reads were cut; a stage that drops blank lines passes the same bytes either way
    (an odd newline that opens an event stays: it is the event's own)."""
    stream = b"data: a\n\n\n\ndata: b\n\n\ndata: c\n\n\n\n\n\n: d\n\n"
    want = [b"data: a\n\n", b"data: b\n\n", b"\ndata: c\n\n", b": d\n\n"]
    for cut in range(len(stream) + 1):
        evs = [ev for read in sse.read([stream[:cut], stream[cut:]]) for ev in read]
        assert b"".join(ev.raw for ev in evs) == stream, cut      # the writer's bytes
        assert [ev.bare().raw for ev in evs if not ev.blank] == want, cut
        assert all(ev.bare().data == ev.data for ev in evs)
    plain = sse.parse_event(b"data: x\n\n")
    assert plain.bare() is plain


def test_a_one_line_data_event_parses_as_the_general_case_does():
    """parse_event's shortcut for a single `data: ` line (most of a model's stream)
    gives what the line-by-line parse gives."""
    for raw in (b"data: {}\n\n", b'data: {"a":"\xc3\xa9"}\n\n', b"data:  two spaces\n\n",
                b"data: [DONE]\n\n", b"data: \n\n", b"data: bad \xff\n\n"):
        ev, ref = sse.parse_event(raw), sse.parse_event(b"id: 1\n" + raw)
        assert (ev.data, ev.name, ev.raw) == (ref.data, ref.name, raw), raw
    ev = sse.parse_event(b"data: a\ndata: b\n\n")            # two lines: not the shortcut
    assert ev.data == "a\nb"
