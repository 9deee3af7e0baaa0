"""``load_rgb`` in several threads at once (``cli serve`` decodes uploads in ``serve.decode_threads`` threads): the
decompression-bomb warning stays an error for every photo being decoded, and nothing is left in the process-wide
warning filters afterwards (``warnings.catch_warnings`` is not thread-safe: a thread leaving it restores the
filters it saw on entry, dropping another thread's)."""

from __future__ import annotations

import io
import threading
import warnings

from PIL import Image

import extractors.preprocess as pre


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


def test_two_threads_keep_the_bomb_warning_an_error_and_leave_the_filters_as_they_were(monkeypatch) -> None:
    before = list(warnings.filters)
    a_inside, b_inside, a_done = threading.Event(), threading.Event(), threading.Event()
    raised: dict[str, bool] = {}
    real = pre._to_rgb_uint8

    def convert(im):  # runs inside load_rgb's bomb-warning scope
        name = threading.current_thread().name
        if name == "A":
            a_inside.set()
            assert b_inside.wait(10)  # B enters while A is inside, then A leaves first
        else:
            b_inside.set()
            assert a_done.wait(10)
            try:  # what Image.open does for a photo over Image.MAX_IMAGE_PIXELS
                warnings.warn("bomb", Image.DecompressionBombWarning)
                raised[name] = False
            except Image.DecompressionBombWarning:
                raised[name] = True
        return real(im)

    monkeypatch.setattr(pre, "_to_rgb_uint8", convert)
    data = _png()
    a = threading.Thread(target=lambda: (pre.load_rgb(data), a_done.set()), name="A")
    b = threading.Thread(target=lambda: pre.load_rgb(data), name="B")
    a.start()
    assert a_inside.wait(10)
    b.start()
    a.join(10)
    b.join(10)
    assert raised == {"B": True}  # still an error in B after A left
    assert warnings.filters == before  # nothing leaked


def test_a_photo_over_pillows_bomb_limit_is_too_large(monkeypatch) -> None:
    """Between Pillow's MAX_IMAGE_PIXELS and twice it Pillow only warns; load_rgb refuses it (too_large), and the
    same photo decodes once the limit is above it."""
    import pytest

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 50)  # the 8x8 photo: 64 pixels, a warning (not Pillow's error)
    with pytest.raises(pre.ImageLoadError) as err:
        pre.load_rgb(_png(), max_pixels=10_000)
    assert err.value.reason == "too_large"
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    assert pre.load_rgb(_png(), max_pixels=10_000).shape == (8, 8, 3)
