"""The timeline is valid Chrome-trace JSON, even after the writer is killed."""

from __future__ import annotations

import pytest

from ronde.core.timeline import load
from ronde.testing import RanksFailedError, run_ranks

from . import workers


def _phases(events):
    return {e["name"] for e in events if e.get("ph") == "X"}


@pytest.mark.timeout(60)
def test_timeline_records_every_phase(tmp_path):
    path = tmp_path / "timeline.json"
    run_ranks(2, workers.timeline_job, str(path), False, timeout_s=50,
              env={"RONDE_TIMELINE": str(path), "RONDE_TIMELINE_MARK_CYCLES": "1"})
    import json

    strict = json.loads(path.read_text())  # closed cleanly: strict JSON
    events = load(str(path))
    assert len(strict) == len(events) + 1
    phases = _phases(events)
    assert {"QUEUE", "NEGOTIATE", "ALLREDUCE", "ALLGATHER", "TRANSFER"} <= phases, phases
    assert "INLINE_REDUCE" in phases  # repeated small allreduces ride with negotiation
    rows = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"grad.0", "grad.3", "big", "gathered"} <= rows
    assert any(e.get("ph") == "i" for e in events)  # cycle markers


@pytest.mark.timeout(60)
def test_timeline_is_loadable_after_sigkill(tmp_path):
    path = tmp_path / "killed-{rank}.json"
    with pytest.raises(RanksFailedError):
        run_ranks(2, workers.timeline_job, str(path), True, timeout_s=50,
                  env={"RONDE_TIMELINE": str(path)})
    events = load(str(tmp_path / "killed-0.json"))
    assert "NEGOTIATE" in _phases(events) and len(events) > 20
    assert "NEGOTIATE" in _phases(load(str(tmp_path / "killed-1.json")))


@pytest.mark.timeout(60)
def test_horovods_dynamic_timeline_writes_nothing_until_start_timeline(tmp_path):
    # Horovod's own test_torch.py sets HOROVOD_TIMELINE=DYNAMIC: no file named DYNAMIC
    # (ronde wrote one in the working directory); start_timeline/stop_timeline record
    # exactly what runs between them
    folder = tmp_path / "tl"
    folder.mkdir()
    seen = run_ranks(2, workers.dynamic_timeline_job, str(folder), timeout_s=50,
                     env={"HOROVOD_TIMELINE": "DYNAMIC"})
    for rank_seen in seen:
        assert "DYNAMIC" not in rank_seen[0], rank_seen
    assert sorted(p.name for p in folder.iterdir()) == ["dyn-0.json", "dyn-1.json"]
    rows = {e["args"]["name"] for e in load(str(folder / "dyn-0.json"))
            if e.get("name") == "thread_name"}
    assert "during" in rows and not {"before", "after"} & rows, rows
