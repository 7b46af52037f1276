"""Incremental decoding gives the full decode back; stop strings are cut and never leaked."""

from lmforge.infer.detokenize import IncrementalDecoder, StopMatcher
from lmforge.tokenizer import Tokenizer


def test_incremental_decode_equals_full_decode_with_multibyte_text():
    text = "héllo wörld — naïve café 日本語テキスト " * 3
    tok = Tokenizer.train_bpe([text], vocab_size=300)
    ids = tok.encode(text)
    dec = IncrementalDecoder(tok)
    pieces = [dec.push(i) for i in ids]
    assert "".join(pieces) == tok.decode(ids, True) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_matcher_holds_back_partial_stops_and_cuts():
    m = StopMatcher(["END"])
    assert m.push("abc E") == "abc "  # "E" might start "END"
    assert m.push("x") == "Ex"
    assert m.push("yEN") == "y"
    assert m.push("D tail") == "" and m.stopped
    assert m.text == "abc Exy"


def test_stop_matcher_flushes_held_text_at_the_end():
    m = StopMatcher(["###"])
    assert m.push("a#") == "a"
    assert m.flush() == "#"
