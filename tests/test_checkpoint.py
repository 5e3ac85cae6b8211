"""A checkpoint's RNG files hold a tensor and plain data, load with weights_only=True, and a crafted
one is refused without running it. The whole run killed and resumed: tests/test_distill.py."""

from __future__ import annotations

import contextlib
import pickle
import random

import numpy as np
import pytest
import torch

from tests.test_faults import FilesTokenizer, FilesTrainer
from turnopd.core import checkpoint as ckpt


def draws() -> tuple[float, float, float]:
    """One number from each RNG a checkpoint restores: Python's, NumPy's and torch's."""
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def scramble() -> None:
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)


def test_rng_states_are_plain_data_and_restore_the_draws(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.randn()  # NumPy's cached Gaussian is part of its state too
    saved = ckpt.save_checkpoint(tmp_path / "run", 1, FilesTrainer(1000), FilesTokenizer(), {}, keep_last=1)
    expected = draws()
    rng_file = saved / "rng_0.pt"
    # torch's own weights-only loader reads it with no names allowed beyond its defaults
    assert torch.serialization.get_unsafe_globals_in_checkpoint(rng_file) == []
    assert set(torch.load(rng_file, weights_only=True)) == {"python", "numpy", "torch"}
    scramble()
    ckpt.load_rng(saved)
    assert draws() == expected


def test_the_rng_file_of_an_older_checkpoint_still_loads(tmp_path):
    """Before, NumPy's state was saved as get_state() gives it, with its key array as an ndarray."""
    np.random.seed(5)
    np.random.randn()
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
               tmp_path / "rng_0.pt")
    assert torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "rng_0.pt")  # needs NumPy's names
    expected = draws()
    scramble()
    ckpt.load_rng(tmp_path)
    assert draws() == expected


class WritesAMarker:
    """Unpickled, it calls open(marker, "w"): the file appears. Any callable could stand there."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.mark.parametrize("writer", ["torch.save", "pickle"])
def test_a_crafted_rng_file_is_refused_not_run(tmp_path, writer):
    marker = tmp_path / "marker"
    payload = {"python": WritesAMarker(marker), "numpy": None, "torch": None}
    folder = tmp_path / "step"
    folder.mkdir()
    if writer == "torch.save":
        torch.save(payload, folder / "rng_0.pt")
    else:
        (folder / "rng_0.pt").write_bytes(pickle.dumps(payload, protocol=2))
    # the payload works: the loading this replaced (weights_only=False) runs it (a bare pickle, then found
    # to lack torch's header, is refused only after it ran)
    with contextlib.suppress(RuntimeError):
        torch.load(folder / "rng_0.pt", weights_only=False)
    assert marker.exists()
    marker.unlink()

    with pytest.raises(ckpt.CheckpointRefused, match=r"rng_0.pt was not loaded: it names io.open, and loading it "
                                                     r"could run code"):
        ckpt.load_rng(folder)
    assert not marker.exists()
