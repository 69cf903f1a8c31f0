"""The text a client sees: stop strings cut and held back while streaming, split UTF-8 characters held
back, the deltas adding up to the final text (pure functions of actors/frontend.py)."""
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.frontend import stable_delta, visible_text


def test_a_stop_string_is_cut_and_reported():
    assert visible_text("hello world", ("wor",), True, False) == ("hello ", "wor")
    assert visible_text("hello world", ("wor",), True, True) == ("hello wor", "wor")
    # the earliest stop wins; at one position, the longer
    assert visible_text("abcabc", ("ca", "b"), True, False) == ("a", "b")
    assert visible_text("xab", ("a", "ab"), True, True) == ("xab", "ab")


def test_while_streaming_a_possible_stop_start_is_held_back():
    assert visible_text("hello wo", ("world",), False, False) == ("hello ", None)
    assert visible_text("hello wo", ("world",), True, False) == ("hello wo", None)
    assert visible_text("hello", ("xyz",), False, False) == ("hello", None)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="ab\ufffdc", max_size=30), st.lists(st.text(alphabet="abc", min_size=1, max_size=3),
                                                             max_size=3))
def test_streamed_pieces_add_up_and_never_show_a_stop(full, stops):
    stops = tuple(stops)
    sent, pieces = "", []
    for k in range(len(full) + 1):
        # the engine ends a request at its first stop string: that item is the last one
        done = k == len(full) or visible_text(full[:k], stops, True, False)[1] is not None
        text, hit = visible_text(full[:k], stops, done, False)
        d, sent = stable_delta(text, sent, done)
        pieces.append(d)
        if hit is not None:
            break
    final, _ = visible_text(full[:k], stops, True, False)
    assert "".join(pieces) == final
    for s in stops:
        assert s not in "".join(pieces)
