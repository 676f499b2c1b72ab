"""Suite-wide rules: the quick tier, and no quiet skips on CI.

* ``--quick`` (``bash scripts/test.sh --quick``): the edit-test loop's tier. It leaves out
  the folders whose every test starts framework-heavy processes or a cluster engine
  (:data:`SLOW_PARTS`); everything else runs, real processes included.
* ``run_ranks`` workers are forked from a process that imported torch and Dynamo once
  (``RONDE_TESTING_PRELOAD=torch,torch._dynamo``, ``runner/zygote.py``): a torch rank
  then costs its test well under a second of CPU to start instead of 2-3 s (set the
  variable empty to exec every worker). Where torch is not installed (MXNet's venv) the
  workers are exec'd.
* On CI (``CI=true``) every test dependency and machine feature is installed by
  ``.ci/run`` (mpiexec, network namespaces, Java, the MXNet venv...), so a test that skips
  there would hide a failure: it fails instead, unless its reason is one no CI machine of
  this project can meet (:data:`ALLOWED_ON_CI`: a CUDA GPU). On a developer's machine a
  skip stays a skip, with its reason.
* ``RONDE_TEST_TIMEOUT_SCALE`` (a number, default 1) multiplies every test's time limit
  (``@pytest.mark.timeout`` and the ini default). ``scripts/test.sh`` sets 3 for MXNet's
  venv, whose run takes only the main run's idle CPU (nice 15): there a test is slower by
  the scheduler's latency, not hung (CI failed once on two loopback tests at 60 s that
  take 0.65 s unstarved).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

#: left out by --quick: paths under tests/ (see docs/testing.md for their times)
SLOW_PARTS = ("elastic", "ray", "spark", "keras_binding", "tensorflow_binding", "compat",
              "bench", "jax_binding", "integration/test_multihost.py",
              "integration/test_scale.py", "integration/test_intruders.py",
              "torch/test_lightning.py", "torch/test_huggingface.py",
              "integration/test_adasum.py", "torch/test_torch_device_path.py",
              "integration/test_mpi.py", "torch/test_torch_example.py")
#: ... and these items anywhere: the Gloo transport's runs (the other transports run the
#: same scenarios), and tests marked slow
SLOW_WORDS = ("gloo",)
#: skip reasons CI may give: what no CI machine here has (a CUDA GPU); MXNet, which the
#: main venv cannot hold (its tests run in their own venv, after this one)
ALLOWED_ON_CI = ("CUDA", "GPU", "could not import 'mxnet'")
HERE = os.path.dirname(os.path.abspath(__file__))
#: collected first: Ray's modules take one lock in turn (``tests/ray/conftest.py``). Last
#: in the collection, they ran at the suite's end, split between the three workers, each
#: waiting for the lock: 112 s in which one worker trained on Ray and the others waited
#: (a timeline of the main run, docs/testing.md). First, they lie at the head of the first
#: worker's share (pytest-xdist's worksteal steals from the tail), in turn, no waits
FIRST_PARTS = ("ray/",)
#: MXNet needs numpy<1.24: its tests run in their own venv (scripts/mxnet_tests.sh, which
#: scripts/test.sh runs after this one), not skipped here
collect_ignore = [] if importlib.util.find_spec("mxnet") else ["mxnet_binding"]
if importlib.util.find_spec("torch") is not None:
    os.environ.setdefault("RONDE_TESTING_PRELOAD", "torch,torch._dynamo")
#: JAX (and Keras on JAX) ranks spend much of their CPU in XLA's compiler, optimizing
#: tiny programs that then run a few steps: compile them plainly (the tests check what
#: ronde computes, against references computed in the same processes). Measured on the
#: JAX binding's np=2 launch: 33 s of CPU -> 27 s; Keras-on-JAX fit 48 -> 42 s; TensorFlow
#: unchanged (docs/testing.md)
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 "
                      "--xla_llvm_disable_expensive_passes=true")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--quick", action="store_true",
                     help="the quick tier: leave out the slow parts (tests/conftest.py)")


def pytest_ignore_collect(collection_path: os.PathLike[str], config: pytest.Config) -> bool | None:
    if not config.getoption("--quick"):
        return None
    rel = os.path.relpath(os.fspath(collection_path), HERE).replace(os.sep, "/")
    return any(rel == part or rel.startswith(part + "/") for part in SLOW_PARTS) or None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _scale_time_limits(config, items)
    _first(FIRST_PARTS, items)
    if not config.getoption("--quick"):
        return
    keep, drop = [], []
    for item in items:
        slow = item.get_closest_marker("slow") or any(w in item.nodeid for w in SLOW_WORDS)
        (drop if slow else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _first(parts: tuple[str, ...], items: list[pytest.Item]) -> None:
    """Move the items under ``parts`` to the front, keeping both groups' own order."""
    head = [i for i in items if i.nodeid.startswith(tuple("tests/" + p for p in parts))]
    if head:
        picked = set(map(id, head))
        items[:] = head + [i for i in items if id(i) not in picked]


def _scale_time_limits(config: pytest.Config, items: list[pytest.Item]) -> None:
    scale = float(os.environ.get("RONDE_TEST_TIMEOUT_SCALE") or 1)
    if scale == 1:
        return
    default = float(config.getini("timeout") or 0)
    for item in items:
        marker = item.get_closest_marker("timeout")
        limit = float(marker.args[0] if marker and marker.args else
                      marker.kwargs.get("timeout", default) if marker else default)
        if limit > 0:  # prepended: pytest-timeout reads the closest marker
            item.add_marker(pytest.mark.timeout(limit * scale), append=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    _no_quiet_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):  # type: ignore[no-untyped-def]
    """The same for a whole module skipped while collected (``importorskip``)."""
    outcome = yield
    _no_quiet_skip(outcome.get_result())


def _no_quiet_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    """On CI, a skip becomes a failure unless its reason is in ALLOWED_ON_CI."""
    if os.environ.get("CI") != "true" or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if any(word in reason for word in ALLOWED_ON_CI):
        return
    report.outcome = "failed"
    report.longrepr = (f"skipped on CI, where .ci/run installs every test dependency and "
                       f"machine feature: {reason}")
