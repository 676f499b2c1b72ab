"""``save_sharded``'s folder (issue #50): one step whole or the previous one, model and
optimizer together, whatever interrupts the save; nothing removed or overwritten that
ronde did not write; only regular files of the folder read; the umask followed.

One process, a plain optimizer (no job: the checkpoint engine is the same at every
size; the sharded runs at 2 to 4 ranks are in test_torch_sharded.py)."""

from __future__ import annotations

import os
import stat

import pytest
import torch

import ronde.torch as hvd
from ronde import RondeError
from ronde.checkpoint import save_checkpoint

pytestmark = pytest.mark.timeout(60)


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _step(model, opt) -> None:
    opt.zero_grad()
    model(torch.ones(4, 3)).pow(2).sum().backward()
    opt.step()


def _state(model, opt) -> list[torch.Tensor]:
    """The model's weights and the optimizer's moments and step counts, as one list."""
    out = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        out.extend(v.clone() if torch.is_tensor(v) else torch.tensor(v)
                   for _, v in sorted(opt.state[p].items()))
    return out


def _loaded(folder) -> list[torch.Tensor]:
    model, opt = _setup(seed=1)
    hvd.load_sharded(folder, model, opt)
    return _state(model, opt)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_an_interrupted_save_leaves_the_previous_step_whole_and_the_next_save_cleans_up(
        tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    # the user's own files, some named as ronde's files once were: never touched
    mine = {"optim.mine.pt": b"mine", "optim.0-of-1.pt": b"also mine", "model.pt": b"my model",
            "notes.txt": b"notes"}
    for name, data in mine.items():
        (folder / name).write_bytes(data)
    model, opt = _setup()
    _step(model, opt)
    hvd.save_sharded(folder, model, opt)
    first = _state(model, opt)
    assert _same(_loaded(folder), first)
    _step(model, opt)
    second = _state(model, opt)
    assert not _same(first, second)
    real_save = torch.save
    # each point of the save: the optimizer's file, the model's, the index
    for at in (1, 2, 3):
        for crash in (False, True):  # Ctrl-C; a crash, which cleans nothing up
            calls = []

            def interrupted(obj, f, *args, **kwargs):
                calls.append(1)
                real_save(obj, f, *args, **kwargs)
                if len(calls) == at:
                    if crash:
                        monkeypatch.setattr(os, "unlink", lambda *a, **k: None)
                    raise KeyboardInterrupt

            monkeypatch.setattr(torch, "save", interrupted)
            with pytest.raises(KeyboardInterrupt):
                hvd.save_sharded(folder, model, opt)
            monkeypatch.undo()
            # the previous step, model and optimizer together
            assert _same(_loaded(folder), first), (at, crash)
    leftovers = set(os.listdir(folder)) - set(mine) - {"meta.pt"}
    assert any(".tmp" in n for n in leftovers) and any(n.startswith(".ronde-save.")
                                                       for n in leftovers), leftovers
    hvd.save_sharded(folder, model, opt)
    assert _same(_loaded(folder), second)
    _step(model, opt)
    hvd.save_sharded(folder, model, opt)
    assert _same(_loaded(folder), _state(model, opt))
    # the step's three files and the user's, nothing else: no temporary, no record,
    # nothing of the interrupted or replaced steps
    files = sorted(set(os.listdir(folder)) - set(mine))
    meta = torch.load(folder / "meta.pt", weights_only=True)
    assert files == sorted(["meta.pt", meta["model"], *meta["files"]]), files
    for name, data in mine.items():
        assert (folder / name).read_bytes() == data, name


def _forge(folder, **changes) -> None:
    meta = torch.load(folder / "meta.pt", weights_only=True)
    meta.update(changes)
    torch.save(meta, folder / "meta.pt")


def test_the_index_may_name_only_regular_files_of_its_folder(tmp_path):
    folder = tmp_path / "ckpt"
    model, opt = _setup()
    _step(model, opt)
    hvd.save_sharded(folder, model, opt)
    meta = torch.load(folder / "meta.pt", weights_only=True)
    own, weights = meta["files"][0], meta["model"]
    (tmp_path / "outside.pt").write_bytes((folder / own).read_bytes())
    os.mkfifo(folder / "fifo.pt")
    os.symlink(folder / own, folder / "link.pt")
    refusals = {"../outside.pt": "not a file of its folder",
                str(tmp_path / "outside.pt"): "not a file of its folder",
                "fifo.pt": "not a regular file",
                "link.pt": "is a symbolic link"}
    for name, why in refusals.items():
        _forge(folder, files=[name])
        with pytest.raises(RondeError, match=why):
            _loaded(folder)
        _forge(folder, files=[own], model=name)
        with pytest.raises(RondeError, match=why):
            _loaded(folder)
        _forge(folder, model=weights)
    assert _same(_loaded(folder), _state(model, opt))
    # a file cut short or replaced since the save
    with open(folder / own, "r+b") as fh:
        fh.truncate(10)
    with pytest.raises(RondeError, match="has 10 bytes, the index says"):
        _loaded(folder)
    # the index itself a FIFO: refused at once, not a read that waits for a writer
    os.unlink(folder / "meta.pt")
    os.mkfifo(folder / "meta.pt")
    with pytest.raises(RondeError, match="not a regular file"):
        _loaded(folder)


def test_a_folder_of_the_first_format_still_loads(tmp_path):
    folder = tmp_path / "ckpt"
    model, opt = _setup()
    _step(model, opt)
    hvd.save_sharded(folder, model, opt)
    meta = torch.load(folder / "meta.pt", weights_only=True)
    os.rename(folder / meta["model"], folder / "model.pt")
    for key in ("sizes", "model", "model_size"):
        del meta[key]
    meta["format"] = "ronde.sharded/1"
    torch.save(meta, folder / "meta.pt")
    assert _same(_loaded(folder), _state(model, opt))
    # the next save replaces it and leaves the old model.pt (not named with a step id)
    hvd.save_sharded(folder, model, opt)
    assert _same(_loaded(folder), _state(model, opt))
    assert not os.path.exists(folder / meta["files"][0])


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_files_follow_the_umask_as_torch_save_does(tmp_path, umask, mode):
    model, opt = _setup()
    _step(model, opt)
    old = os.umask(umask)
    try:
        hvd.save_sharded(tmp_path / "ckpt", model, opt)
        save_checkpoint({"step": 1}, tmp_path / "plain.pkl")
        torch.save({"step": 1}, tmp_path / "torch.pt")
    finally:
        os.umask(old)
    paths = [tmp_path / "plain.pkl", tmp_path / "torch.pt",
             *(tmp_path / "ckpt" / n for n in os.listdir(tmp_path / "ckpt"))]
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in paths} == \
        {p.name: mode for p in paths}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_state_comes_back_bit_for_bit(tmp_path, dtype):
    # the torch codec keeps each tensor's dtype: no pass through numpy, which has no bfloat16
    model, opt = _setup()
    model.to(dtype)
    opt.zero_grad()
    model(torch.ones(4, 3, dtype=dtype)).pow(2).sum().backward()
    opt.step()
    hvd.save_sharded(tmp_path / "ckpt", model, opt)
    other, fresh = _setup(seed=1)
    other.to(dtype)
    hvd.load_sharded(tmp_path / "ckpt", other, fresh)
    loaded, saved = _state(other, fresh), _state(model, opt)
    assert all(x.dtype == y.dtype for x, y in zip(loaded, saved))
    assert any(x.dtype == dtype for x in loaded[len(list(model.parameters())):])
    assert _same(loaded, saved)
