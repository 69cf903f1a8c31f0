"""Which workers serve a request (actors/served.py), from a backend's choice to the HTTP answer: the
JSON users read in SGLang's ``meta_info.route``, the stream that carries the choice beside its items
(not on them), and the frontend that keeps it on the sample and pins a prompt's other samples to it."""
import asyncio
import time

import pytest

from actors.frontend import Frontend, Sample
from actors.served import Served, ServedStream
from engine.stream import StreamItem
from engine.sampling import SamplingParams


def test_the_route_json_is_what_users_have_always_read():
    assert Served("prefill-0", "decode-1", 48).route_json() == \
        {"prefill": "prefill-0", "decode": "decode-1", "predicted_cached_tokens": 48}
    assert Served("prefill-0", "decode-1", 0).route_json()["predicted_cached_tokens"] == 0   # a cold prompt
    assert Served("colocated-0").route_json() == {"prefill": "colocated-0", "decode": None}  # nobody predicted
    assert list(Served("p", "d", 1).route_json()) == ["prefill", "decode", "predicted_cached_tokens"]


def _items(n):
    return [StreamItem("r", [i], finished=i == n - 1) for i in range(n)]


async def _gen(*xs):
    for x in xs:
        yield x


def test_a_served_stream_gives_the_choice_beside_its_items():
    async def go():
        s = ServedStream(_gen(Served("p", "d", 16), *_items(3)))
        assert s.served is None                     # not chosen before the stream starts
        got = [x async for x in s]
        return s.served, got
    served, got = asyncio.run(go())
    assert served == Served("p", "d", 16) and [i.token_ids for i in got] == [[0], [1], [2]]


def test_a_stream_that_does_not_say_who_serves_it_is_refused():
    async def go():
        return [x async for x in ServedStream(_gen(*_items(1)))]
    with pytest.raises(TypeError):
        asyncio.run(go())


class Backend:
    """A backend that records the pins it is asked for and serves where it is pinned."""
    model_name, max_context, vocab_size, tokenizer, sampling_defaults = "m", 64, 32, None, {}

    def __init__(self):
        self.pins = []

    def stream(self, ids, params, avoid=(), pin=None, whole=False):
        self.pins.append(pin)
        return ServedStream(_gen(pin or Served("prefill-0", "decode-0", 16), *_items(2)))


def test_the_frontend_keeps_who_served_a_sample_and_pins_the_prompts_other_samples_there():
    b = Backend()
    fe = Frontend(b)

    async def go():
        pin, warm = await fe.warm([1, 2, 3], 2)
        samples = fe.samples([1, 2, 3], SamplingParams(max_new_tokens=2), 2)
        done = await fe.collect_all(samples, [Served(pin.prefill, pin.decode)] * 2)
        started = await fe.start_streams([Sample(9, [1, 2], SamplingParams(max_new_tokens=2))], [None])
        return pin, warm, done, started
    pin, warm, done, started = asyncio.run(go())
    assert pin == Served("prefill-0", "decode-0", 16) and warm.finished
    assert b.pins == [None, Served("prefill-0", "decode-0"), Served("prefill-0", "decode-0"), None]
    assert [s.served for s in done] == [Served("prefill-0", "decode-0")] * 2
    assert started[0][0].served == Served("prefill-0", "decode-0", 16)    # known once its first item came


def test_a_whole_answers_ttft_counts_from_when_its_first_token_was_made():
    """A non-streamed request asks for its items merged (whole=True); its TTFT metric takes off the time its
    first token waited on the worker (held_s), and the merged tokens' inter-token time is spread over them."""
    asked = []

    class Merged:
        model_name, max_context, vocab_size, tokenizer, sampling_defaults = "m", 64, 32, None, {}

        def stream(self, ids, params, avoid=(), pin=None, whole=False):
            asked.append(whole)

            async def gen():
                yield Served("colocated-0")
                await asyncio.sleep(0.3)   # the worker held the tokens this long (and said so)
                yield StreamItem("r", [1, 2, 3, 4], True, "length", held_s=0.25)
            return ServedStream(gen())

    fe = Frontend(Merged())
    t = time.perf_counter()
    s = asyncio.run(fe.collect(Sample(0, [1, 2], SamplingParams(max_new_tokens=4))))
    wall = time.perf_counter() - t
    assert s.token_ids == [1, 2, 3, 4] and asked == [True]
    _, ttft, n = fe.metrics.hist["strata_ttft_seconds"]
    assert n == 1 and 0 < ttft <= wall - 0.25, (ttft, wall)    # not the >= 0.3 s it took to arrive
    _, itl, k = fe.metrics.hist["strata_inter_token_seconds"]
    assert k == 1 and abs(itl - 0.25 / 3) < 1e-9              # 0.25 s over the 3 tokens after the first
