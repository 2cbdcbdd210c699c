"""TextStream (rollout/agent_replies.py), the text a streamed turn sends as its ids arrive: what
it sends, joined with its `rest` of the final decode, is exactly the final text cut at the first
stop string, whatever the chunking (one id at a time, or several), on a byte-level BPE tokenizer
whose multi-byte characters span tokens and on the quickstart's word-level one (whose decode
joins words with spaces); and each push decodes only a window of new ids (O(n) over a turn),
not the whole turn again."""

from __future__ import annotations

import random

import pytest

from rlhf_megatron import quickstart as rl_quickstart
from rlhf_megatron import quickstart_tools
from rlhf_megatron.rollout.agent_replies import TextStream, cut_at_stop
from rlhf_megatron.testing.tiny_models import train_tiny_tokenizer

TEXTS = [
    "the answer is 42. Done, and more text after it",
    "héllo wörld: 数学 is math 🙂 and ünïcödé ends here",
    "call(tool) -> 7\n\nThe answer: 7 STOP and then some",
]
STOPS = [[], ["STOP"], ["\n\n", "Done"], ["🙂"]]


class CountingTokenizer:
    """A tokenizer whose decode counts the ids it was given."""

    def __init__(self, inner) -> None:
        self.inner, self.decoded_ids = inner, 0

    def decode(self, ids, **kwargs) -> str:
        self.decoded_ids += len(ids)
        return self.inner.decode(ids, **kwargs)


@pytest.fixture(scope="module")
def byte_bpe(tmp_path_factory):
    return train_tiny_tokenizer(tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="module")
def word_level(tmp_path_factory):
    return rl_quickstart.write_tokenizer(tmp_path_factory.mktemp("words"),
                                         quickstart_tools.vocabulary(),
                                         quickstart_tools.CHAT_TEMPLATE)


def _stream(tokenizer, ids: list[int], stop: list[str], chunk: int) -> str:
    stream = TextStream(tokenizer, stop)
    sent = "".join(stream.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk))
    final = cut_at_stop(tokenizer.decode(ids, skip_special_tokens=True), stop)
    assert final.startswith(sent), (sent, final)
    return sent + stream.rest(final)


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("stop", STOPS, ids=["none", "word", "two", "emoji"])
def test_streamed_text_is_the_final_text_on_a_byte_level_bpe(byte_bpe, stop, chunk):
    for text in TEXTS:
        ids = byte_bpe.encode(text, add_special_tokens=False)
        assert any(byte_bpe.decode([i]).endswith("\ufffd") for i in ids) or text.isascii()
        assert _stream(byte_bpe, ids, stop, chunk) == cut_at_stop(text, stop)


def test_streamed_text_is_the_final_text_on_the_word_level_tokenizer(word_level):
    vocab = [w for w in quickstart_tools.vocabulary() if w.isalnum()]
    rng = random.Random(0)
    for _ in range(20):
        words = [rng.choice(vocab) for _ in range(rng.randint(1, 30))]
        ids = word_level.convert_tokens_to_ids(words)
        stop = [rng.choice(vocab)]
        final = cut_at_stop(word_level.decode(ids, skip_special_tokens=True), stop)
        assert _stream(word_level, ids, stop, rng.randint(1, 4)) == final


def test_each_push_decodes_a_window_not_the_whole_turn(byte_bpe):
    ids = byte_bpe.encode(" ".join(TEXTS) * 8, add_special_tokens=False)
    assert len(ids) > 500
    tokenizer = CountingTokenizer(byte_bpe)
    stream = TextStream(tokenizer, ["never seen"])
    sent = "".join(stream.push([i]) for i in ids)
    assert sent + stream.rest(byte_bpe.decode(ids)) == byte_bpe.decode(ids)
    # Two windows a push, of CONTEXT (4) old ids and the new one: measured 9,844 ids decoded
    # for 1,080 pushed. Decoding the whole turn a push is ~n^2: over 1M ids here.
    assert TextStream.CONTEXT == 4
    assert tokenizer.decoded_ids <= 10 * len(ids), tokenizer.decoded_ids
