"""The pixel store: content keys, put/get/missing/free, another process's puts, and no torn image
after a writer is killed."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from turnopd.core.pixels import CLOCK_MARGIN_S, KEY_CHARS, PixelStore, default_pixel_root


def screen(value: int, shape=(12, 6)) -> np.ndarray:
    return np.full(shape, value, dtype=np.uint8)


def test_key_is_the_hash_of_dtype_shape_and_bytes(tmp_path):
    pixels = np.arange(6, dtype=np.uint8).reshape(2, 3)
    expected = hashlib.blake2b(b"|u1(2, 3)" + bytes(range(6)), digest_size=16).hexdigest()
    assert PixelStore.key_of(pixels) == expected and len(expected) == KEY_CHARS
    # the same bytes in another shape are another picture
    assert PixelStore.key_of(pixels.reshape(3, 2)) != expected


def test_put_get_missing_free(tmp_path):
    store = PixelStore(tmp_path / "px")
    assert not store.root.exists()  # nothing written, nothing made
    a, b = store.put(screen(1)), store.put(screen(2))
    assert store.put(screen(1)) == a and store.stats()["stored"] == 2  # stored once
    assert store.stats()["bytes"] == 2 * os.path.getsize(store.path(a))
    got = store.get([a, "f" * KEY_CHARS, b])
    assert set(got) == {a, b} and np.array_equal(got[a], screen(1)) and got[b].dtype == np.uint8
    assert store.missing([a, "f" * KEY_CHARS, "f" * KEY_CHARS]) == ["f" * KEY_CHARS]
    assert store.free([a, a, "f" * KEY_CHARS]) == 1 and store.missing([a, b]) == [a]
    assert list(store.root.glob("*.tmp")) == []
    assert store.clear() == 1 and not store.root.exists()


def test_free_keeps_what_was_put_again_after_the_cut_off(tmp_path):
    store = PixelStore(tmp_path)
    old, again = store.put(screen(1)), store.put(screen(2))
    past = time.time() - 100
    os.utime(store.path(old), (past, past))
    os.utime(store.path(again), (past, past))
    cut_off = time.time() - 50
    assert store.put(screen(2)) == again  # an episode still playing drew the same page since
    assert store.free([old, again], put_before=cut_off) == 1
    assert store.missing([old, again]) == [old]


def test_free_unheld_keeps_what_playing_episodes_or_untrained_trajectories_hold(tmp_path):
    """Pages put at t = 1000, 2000, 3000 s; an episode still playing began at 2000.5 + the clock
    margin: the page of 1000 is a received trajectory's (held), that of 3000 is newer than the
    episode, so only the page of 2000 goes."""
    store = PixelStore(tmp_path)
    held, old, new = store.put(screen(1)), store.put(screen(2)), store.put(screen(3))
    for key, t in ((held, 1000), (old, 2000), (new, 3000)):
        os.utime(store.path(key), (t, t))
    assert store.free_unheld(2000.5 + CLOCK_MARGIN_S, held=[held]) == 1
    assert store.missing([held, old, new]) == [old]
    assert store.free_unheld(time.time() + CLOCK_MARGIN_S + 1) == 2 and store.keys() == []


def test_a_free_waits_for_a_put_in_progress(tmp_path):
    """The folder's lock: while a put holds it (shared), a free cannot look at a page's time and
    delete it in between; it deletes once the put is done."""
    import fcntl
    import threading

    store = PixelStore(tmp_path)
    key = store.put(screen(1))
    past = time.time() - 100
    os.utime(store.path(key), (past, past))
    with store._locked(fcntl.LOCK_SH):  # a put's part, as an env worker holds it
        freeing = threading.Thread(target=store.free, args=([key],), kwargs={"put_before": time.time()})
        freeing.start()
        freeing.join(0.3)
        assert freeing.is_alive() and store.missing([key]) == []  # waiting, nothing deleted
    freeing.join(10)
    assert not freeing.is_alive() and store.missing([key]) == [key]


def test_another_process_puts_and_this_one_reads(tmp_path):
    code = ("import numpy as np; from turnopd.core.pixels import PixelStore; "
            f"print(PixelStore({str(tmp_path)!r}).put(np.full((12, 6), 7, dtype=np.uint8)))")
    key = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert np.array_equal(PixelStore(tmp_path).get([key])[key], screen(7))


def test_a_killed_writer_leaves_whole_images_only(tmp_path):
    """A writer killed (SIGKILL) in the middle of its puts: every key in the store loads whole (a file
    appears under its key only once complete), and what it had not finished is simply missing."""
    code = (f"import numpy as np; from turnopd.core.pixels import PixelStore; s = PixelStore({str(tmp_path)!r})\n"
            "for i in range(100000): s.put(np.full((576, 576), i % 251, dtype=np.uint8) + np.uint8(i // 251))")
    writer = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.time() + 60
    while len(list(tmp_path.glob("*.npy"))) < 20 and time.time() < deadline:
        time.sleep(0.05)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    store = PixelStore(tmp_path)
    keys = [p.stem for p in tmp_path.glob("*.npy")]
    assert len(keys) >= 20
    for key, pixels in store.get(keys).items():
        assert pixels.shape == (576, 576) and PixelStore.key_of(pixels) == key


def test_default_root_is_per_run(tmp_path):
    assert default_pixel_root("a") != default_pixel_root("b")
    assert default_pixel_root("a").name == "a"


@pytest.mark.parametrize("bad", ["", "../" + "0" * (KEY_CHARS - 3), "A" * KEY_CHARS])
def test_a_key_that_is_not_a_hex_digest_is_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="not a pixel-store key"):
        PixelStore(tmp_path).missing([bad])
