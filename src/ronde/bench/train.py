"""Training throughput: ronde's DistributedOptimizer vs DDP (Gloo) vs one process.

``python -m ronde.bench.train [--np 2 | --np 1,2,4,8] [--steps 30] [--models cnn,transformer,resnet]``
measures samples/s of a small CNN (3x32x32 inputs, 8 gradient tensors), a small
transformer encoder (sequence 32, width 128, 26 tensors) and a ResNet-18-shaped CNN
(basic blocks ``[2, 2, 2, 2]``, batch norm, 62 tensors of 10 to 147,456 values, 0.70 M in all; widths
16-128, a quarter of ResNet-18's, so that a CPU step takes tens of milliseconds) on the
CPU, one thread per rank, for:

* ``single``: one process, the per-rank batch (the baseline);
* ``ronde``: ``--np`` ranks started by ronde's launcher, ``ronde.torch.DistributedOptimizer``;
* ``autotune`` (with ``--autotune``): ``ronde`` under ``RONDE_AUTOTUNE=1``, its tuning
  steps (docs/autotune.md) added to the warm-up, so the timed steps use what it chose;
* ``ddp``: ``--np`` processes with ``torch.nn.parallel.DistributedDataParallel`` over Gloo,
  started the way :mod:`ronde.bench._gloo` starts its workers.

Each rank trains on a fixed random batch of ``--batch`` samples; the first ``--warmup``
steps are not timed. Besides samples/s, each rank counts the CPU time of its whole
process (every thread: ``resource.getrusage``) over the timed steps, less the GIL
probe's own (below); the table shows the CPU milliseconds per step per rank beyond the
single process's (what the library costs a rank: its threads, copies and reductions; on
a machine with one rank per core that is time the backward pass does not get). The
probe is the bench's instrument, not a contender's: it wakes a thousand times a wall
second, so with more ranks than cores (a step of 120 ms of wall time at np=8 here, 27
alone) it costs a rank about 1-2 ms of CPU a step more than it costs the single process,
which the extra CPU would otherwise charge to the library (measured with each thread's
CPU from ``/proc/self/task``: ronde's transformer at np=8 spent 29.6 ms a step in the
training thread, 0.9 in the control thread, 1.0 in the executor, while ``getrusage``
said 35.8). Eight independent single processes on the two cores, no communication at
all, spend 29.2 ms a step each against 27.1 alone: contention alone is part of any
contender's extra CPU at np=8.

**Paired extra CPU** (``--paired-steps``, default ``--steps``): that difference takes its
baseline from another process at another time, and the single process's CPU a step
moved by 4 ms between runs here (24.6-28.9 ms for the transformer), twice the quantity
measured. So after the timed steps each rank also runs pairs of one library step and one
step of an identical model without the library, in turn (:func:`_paired`): the same
process, the same contention from the other ranks (they run their plain steps at the
same time), the same drift of the machine on both halves. Its figure is what a library
step costs beyond a plain one, every thread counted; the ``single`` contender runs it
with two plain models, which gives the instrument's floor (about 0). The table shows
the median of the rounds.

**Allocation** (``--malloc``): ``default``, glibc's own behaviour, as users run.
``steady`` gives every contender's processes (the single one too) glibc's ``mmap``
threshold fixed at 32 MiB and trimming off (``GLIBC_TUNABLES``, :data:`STEADY_MALLOC`):
with glibc's sliding threshold the ResNet's activations are mapped and unmapped again
from one step to the next, or not, and identical steps of one plain process varied in
CPU time with a standard deviation of 8-10 ms a 100 ms step; fixed, 2-4 ms, the paired
floor ~0. A diagnostic: it changes the workload (every step gets faster, DDP's most).

**GIL wait**: a probe thread in every rank (every contender, the single process too)
sleeps 1 ms at a time through the timed steps and sums how late it wakes: the time a
thread that wants the GIL (and a core) back waits for it. The training thread is such a
thread each time a torch call that released the GIL returns, so the probe's lateness
beyond the single process's is what the library's threads (ronde's control and
executor threads, Gloo's) make the training thread wait per step, measured the same
way for every contender. Prints one JSON line per point, then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Sequence

from ._gloo import free_port
from ._stats import median


def _model(torch: Any, name: str) -> tuple[Any, Any, Any]:
    nn = torch.nn
    torch.manual_seed(0)
    if name == "cnn":
        model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(),
                              nn.Linear(128, 10))
        return model, (3, 32, 32), 10
    if name == "transformer":
        layer = nn.TransformerEncoderLayer(128, 4, 256, batch_first=True, dropout=0.0)
        model = nn.Sequential(nn.TransformerEncoder(layer, 2), nn.Flatten(),
                              nn.Linear(32 * 128, 10))
        return model, (32, 128), 10
    if name == "resnet":
        return _resnet18(nn, width=16), (3, 32, 32), 10
    raise ValueError(f"unknown model {name!r}")


def _resnet18(nn: Any, width: int) -> Any:
    """ResNet-18's layout (basic blocks [2, 2, 2, 2], 1x1 downsample with batch norm
    where the stride or width changes) for 32x32 inputs, at base ``width``."""

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                nn.ReLU(), nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
            self.short = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            self.relu = nn.ReLU()

        def forward(self, x: Any) -> Any:
            return self.relu(self.body(x) + self.short(x))

    layers: list[Any] = [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
                         nn.ReLU()]
    cin = width
    for i, cout in enumerate((width, 2 * width, 4 * width, 8 * width)):
        for b in range(2):
            layers.append(Block(cin, cout, 2 if (b == 0 and i > 0) else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10)]
    return nn.Sequential(*layers)


#: the glibc tunables of every contender's processes (``--malloc steady``: module docstring)
STEADY_MALLOC = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967295"


def _worker_env(malloc: str) -> dict[str, str]:
    """What every contender's processes get in their environment besides the bench's."""
    env = {"OMP_NUM_THREADS": "1"}
    if malloc == "steady":
        mine = os.environ.get("GLIBC_TUNABLES")
        env["GLIBC_TUNABLES"] = f"{mine}:{STEADY_MALLOC}" if mine else STEADY_MALLOC
    return env


def _cpu_s() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return ru.ru_utime + ru.ru_stime


class _GilProbe:
    """A thread that sleeps :data:`PROBE_S` at a time and sums how late it wakes (see
    the module docstring: what a thread waiting for the GIL and a core waits)."""

    PROBE_S = 0.001

    def __init__(self) -> None:
        self.late_s = 0.0
        self.cpu_s = 0.0  #: the probe thread's own CPU time (not charged to a contender)
        self.wakeups = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-gil-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        clock, nap = time.perf_counter, self.PROBE_S
        c0 = time.thread_time()
        while not self._stop.is_set():
            t0 = clock()
            time.sleep(nap)
            self.late_s += max(0.0, clock() - t0 - nap)
            self.wakeups += 1
        self.cpu_s = time.thread_time() - c0

    def stop(self) -> float:
        """Stop; the lateness summed over the run, in seconds."""
        self._stop.set()
        self._thread.join()
        return self.late_s


def _train(mode: str, model_name: str, batch: int, steps: int, warmup: int,
           rank: int = 0, world: int = 1, on_timed: Any = None, on_done: Any = None,
           paired: int = 0) -> tuple[float, float, float, float]:
    """Run the loop in this process; return (samples/s over all ranks, this process's
    CPU milliseconds per timed step, the GIL probe's lateness in milliseconds per timed
    step, the paired extra CPU in milliseconds per step: see :func:`_paired`, NaN
    without ``paired`` steps). ``on_timed()`` is called as the timed steps begin,
    ``on_done()`` as they end (before the paired steps)."""
    import copy

    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    model, shape, classes = _model(torch, model_name)
    plain = copy.deepcopy(model)  # no library on it: the paired steps' baseline
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if mode == "ronde":
        import ronde.torch as hvd

        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    elif mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, *shape, generator=gen)
    y = torch.randint(0, classes, (batch,), generator=gen)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    def plain_step() -> None:
        plain_opt.zero_grad()
        F.cross_entropy(plain(x), y).backward()
        plain_opt.step()

    t0 = c0 = 0.0
    probe: _GilProbe | None = None
    for i in range(warmup + steps):
        if i == warmup:
            if on_timed is not None:
                on_timed()
            probe = _GilProbe()
            t0, c0 = time.perf_counter(), _cpu_s()
        step()
    elapsed = time.perf_counter() - t0
    cpu_s = _cpu_s() - c0
    if on_done is not None:
        on_done()
    assert probe is not None
    wait_ms = probe.stop() * 1e3 / steps
    cpu_ms = (cpu_s - probe.cpu_s) * 1e3 / steps  # the instrument's CPU is nobody's
    paired_ms = _paired(step, plain_step, paired) if paired else float("nan")
    return world * batch * steps / elapsed, cpu_ms, wait_ms, paired_ms


def _paired(step: Any, plain_step: Any, steps: int) -> float:
    """The **paired extra CPU**: ``steps`` pairs of one step through the library and
    one step of an identical model without it, in turn, in the same process; returns
    the CPU milliseconds a library step costs beyond a plain one.

    The library's side is the whole process's CPU over the pairs (every thread, at any
    time: what its threads do while the plain step runs is charged to it too), less the
    training thread's CPU in the plain steps and the GIL probe's own; the plain side is
    the training thread's CPU in the plain steps. Every rank runs its plain step at the
    same time as the others (the library step before it ended together), so the plain
    steps share the cores as the library steps do, and a drift of the machine's speed
    over the run falls on both halves alike: unlike the difference from the ``single``
    process, measured in another process at another time (whose CPU a step moved by
    4 ms between runs here, twice the quantity measured), it needs no baseline from
    elsewhere. The ``single`` contender runs it too, two plain models: its figure is the
    instrument's floor (about 0)."""
    for _ in range(2):  # the plain model's first steps allocate
        plain_step()
    probe = _GilProbe()
    c0, plain_s = _cpu_s(), 0.0
    for _ in range(steps):
        step()
        p0 = time.thread_time()
        plain_step()
        plain_s += time.thread_time() - p0
    probe.stop()
    library_s = _cpu_s() - c0 - probe.cpu_s - plain_s
    return (library_s - plain_s) * 1e3 / steps


def ronde_threads_cpu_s() -> dict[str, float]:
    """The CPU time of each of ronde's own threads in this process (``ronde-*``: the
    control thread, the executor...), by name, from each thread's CPU clock."""
    out: dict[str, float] = {}
    for t in threading.enumerate():
        if t.name.startswith("ronde-") and t.ident is not None:
            try:
                out[t.name] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except (OSError, ValueError):  # it just ended
                pass
    return out


def _engine_threads_cpu_s() -> float:
    """The CPU time of ronde's own threads in this process, together."""
    return sum(ronde_threads_cpu_s().values())


def ronde_worker(model_name: str, batch: int, steps: int, warmup: int, paired: int = 0
                 ) -> tuple[float, float, float, float, float, float]:
    """One rank of the ``ronde`` contender (run through :func:`ronde.testing.run_ranks`):
    (samples/s of the slowest rank, the mean CPU ms per step over the ranks, the mean GIL
    probe lateness in ms per step, the mean paired extra CPU ms per step (:func:`_paired`),
    negotiation rounds per timed step: a count, steadier than any time on a shared
    machine; the mean CPU ms per step of ronde's own threads, which no contention with
    the other ranks inflates the way it does the training thread's)."""
    import torch

    import ronde.torch as hvd
    from .. import _state

    hvd.init()
    engine = _state.require().engine
    begin: list[float] = []  # the rounds and ronde's threads' CPU s as timing starts
    per_step: list[float] = []  # rounds a timed step, ronde's threads' CPU ms a timed step

    def timed() -> None:
        begin[:] = [engine._rounds, _engine_threads_cpu_s()]

    def done() -> None:  # read before the paired steps and the reductions below
        per_step[:] = [(engine._rounds - begin[0]) / steps,
                       (_engine_threads_cpu_s() - begin[1]) * 1e3 / steps]

    rate, cpu_ms, wait_ms, paired_ms = _train("ronde", model_name, batch, steps, warmup,
                                              hvd.rank(), hvd.size(), on_timed=timed,
                                              on_done=done, paired=paired)
    rounds, threads_ms = per_step
    worst = float(hvd.allreduce(torch.tensor([1.0 / rate]), op=hvd.Max)[0])
    cpu, wait, paired_ms, threads = (float(v) for v in hvd.allreduce(
        torch.tensor([cpu_ms, wait_ms, paired_ms, threads_ms], dtype=torch.float64),
        op=hvd.Average))
    hvd.shutdown()
    return 1.0 / worst, cpu, wait, paired_ms, rounds, threads  # the slowest rank sets the pace


def _run_ddp(np_: int, model_name: str, batch: int, steps: int, warmup: int, paired: int,
             timeout_s: float, extra_env: dict[str, str]) -> tuple[float, float, float, float]:
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra_env)
    procs = [subprocess.Popen([sys.executable, "-m", "ronde.bench.train", "--ddp-worker",
                               f"{r},{np_},{port}", "--models", model_name, "--batch",
                               str(batch), "--steps", str(steps), "--warmup", str(warmup),
                               "--paired-steps", str(paired)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(np_)]
    ranks = []
    for p in procs:
        out, err = p.communicate(timeout=timeout_s)
        if p.returncode != 0:
            raise RuntimeError(f"ddp worker failed: {err[-2000:]}")
        ranks.append([float(v) for v in out.strip().splitlines()[-1].split()])
    rates, cpus, waits, paired_ms = zip(*ranks)
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    return min(rates), mean(cpus), mean(waits), mean(paired_ms)


def _ddp_worker(spec: str, model_name: str, batch: int, steps: int, warmup: int,
                paired: int) -> None:
    import torch.distributed as dist

    rank, world, port = (int(v) for v in spec.split(","))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    measured = _train("ddp", model_name, batch, steps, warmup, rank, world, paired=paired)
    dist.barrier()
    print(*measured, flush=True)
    # no destroy_process_group() and no interpreter teardown: Gloo may abort a process
    # whose peer tore its pairs down first ("terminate called without an active
    # exception"), which would lose a finished measurement
    sys.stderr.flush()
    os._exit(0)


def _run_single(model_name: str, batch: int, steps: int, warmup: int, paired: int,
                timeout_s: float, extra_env: dict[str, str]) -> tuple[float, float, float, float]:
    code = (f"from ronde.bench.train import _train; print(*_train('single', {model_name!r}, "
            f"{batch}, {steps}, {warmup}, paired={paired}))")
    env = dict(os.environ, **extra_env)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=timeout_s, check=True)
    rate, cpu, wait, paired_ms = (float(v) for v in out.stdout.strip().splitlines()[-1].split())
    return rate, cpu, wait, paired_ms


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "nan"


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""
    p = argparse.ArgumentParser(prog="python -m ronde.bench.train", description=__doc__)
    p.add_argument("--np", default="2", help="ranks, or a comma list (1,2,4,8): a "
                   "scaling table with the efficiency of each")
    p.add_argument("--models", default="cnn,transformer,resnet")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--paired-steps", type=int, default=None,
                   help="pairs of a library step and a plain one after the timed steps, "
                        "for the paired extra CPU (default: --steps; 0: none)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--autotune", action="store_true",
                   help="also ronde after autotuning (RONDE_AUTOTUNE=1; the tuning steps "
                        "are not timed)")
    p.add_argument("--malloc", choices=("default", "steady"), default="default",
                   help="default: glibc's own behaviour; steady: its mmap threshold fixed "
                        "and trimming off in every contender's processes (steadier CPU "
                        "times, a changed workload)")
    p.add_argument("--ddp-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    if args.ddp_worker:
        _ddp_worker(args.ddp_worker, models[0], args.batch, args.steps, args.warmup,
                    args.paired_steps or 0)
        return 0
    from ..testing import run_ranks
    from . import train as importable  # run_ranks imports the worker by module name
    from .. import _config
    from ..core.autotune import search_steps

    counts = [int(n) for n in str(args.np).split(",") if n.strip()]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)
    rows = []
    env = _worker_env(args.malloc)
    for model_name in models:
        best: dict[tuple[str, int], float] = {}  # samples/s: the best round's
        cpu: dict[tuple[str, int], float] = {}  # CPU ms per step per rank: the least
        rounds: dict[tuple[str, int], float] = {}  # ronde's rounds per step: the least
        engine: dict[tuple[str, int], float] = {}  # ronde's threads' CPU ms/step: the least
        wait: dict[tuple[str, int], float] = {}  # GIL probe lateness ms/step: the least
        paired: dict[tuple[str, int], list[float]] = {}  # paired extra CPU: the median
        pairs = args.steps if args.paired_steps is None else args.paired_steps
        for _ in range(args.rounds):  # interleaved: every contender and N once a round
            runs: list[tuple[str, int, Any]] = [("single", 1, lambda n: _run_single(
                model_name, args.batch, args.steps, args.warmup, pairs, args.timeout_s, env))]
            for n in counts:
                if n < 2:
                    continue
                runs.append(("ronde", n, lambda n: run_ranks(
                    n, importable.ronde_worker, model_name, args.batch, args.steps,
                    args.warmup, pairs, timeout_s=args.timeout_s, env=env)[0]))
                if args.autotune:
                    tune_env = dict(env, RONDE_AUTOTUNE="1")
                    extra = search_steps(_config.load(tune_env))
                    runs.append(("autotune", n, lambda n: run_ranks(
                        n, importable.ronde_worker, model_name, args.batch, args.steps,
                        args.warmup + extra, pairs, timeout_s=args.timeout_s,
                        env=tune_env)[0]))
                runs.append(("ddp", n, lambda n: _run_ddp(n, model_name, args.batch,
                                                          args.steps, args.warmup, pairs,
                                                          args.timeout_s, env)))
            for name, n, fn in runs:
                rate, cpu_ms, wait_ms, paired_ms, *counted = fn(n)
                paired.setdefault((name, n), []).append(paired_ms)
                best[(name, n)] = max(best.get((name, n), 0.0), rate)
                cpu[(name, n)] = min(cpu.get((name, n), float("inf")), cpu_ms)
                wait[(name, n)] = min(wait.get((name, n), float("inf")), wait_ms)
                if counted:
                    rounds[(name, n)] = min(rounds.get((name, n), float("inf")), counted[0])
                    engine[(name, n)] = min(engine.get((name, n), float("inf")), counted[1])
        for (name, n), rate in best.items():
            point = {"case": "train", "model": model_name, "contender": name, "np": n,
                     "batch_per_rank": args.batch, "samples_per_s": round(rate, 1),
                     "cpu_ms_per_step": round(cpu[(name, n)], 2),
                     "gil_wait_ms_per_step": round(wait[(name, n)], 3),
                     "paired_extra_cpu_ms_per_step": round(median(paired[(name, n)]), 2)}
            if (name, n) in rounds:
                point["rounds_per_step"] = round(rounds[(name, n)], 2)
                point["engine_threads_cpu_ms_per_step"] = round(engine[(name, n)], 2)
            print(json.dumps(point), flush=True)
        rows.append((model_name, best, cpu, rounds, wait, engine,
                     {k: median(v) for k, v in paired.items()}))
    print("\n| model | N | single | ronde | ddp | ronde/ddp | ronde eff. | ddp eff. | "
          f"ronde eff. within {cores} cores | CPU ms/step single | extra CPU ms/step ronde "
          "| ddp | ronde/ddp | paired extra CPU ms/step single | ronde | ddp | ronde/ddp "
          "| ronde's threads CPU ms/step | rounds/step ronde "
          "| GIL wait ms/step single | ronde | ddp |")
    print("|---" * 22 + "|")
    for model_name, best, cpu, rounds, wait, engine, pair in rows:
        single, c1 = best[("single", 1)], cpu[("single", 1)]
        for n in counts:
            if n < 2:
                continue
            r, d = best[("ronde", n)], best[("ddp", n)]
            xr, xd = cpu[("ronde", n)] - c1, cpu[("ddp", n)] - c1
            print(f"| {model_name} | {n} | {single:.1f} | {r:.1f} | {d:.1f} | {r / d:.2f} | "
                  f"{r / (n * single):.2f} | {d / (n * single):.2f} | "
                  f"{r / (min(n, cores) * single):.2f} | {c1:.1f} | {xr:.1f} | {xd:.1f} | "
                  f"{_ratio(xr, xd)} | "
                  f"{pair[('single', 1)]:.1f} | {pair[('ronde', n)]:.1f} | "
                  f"{pair[('ddp', n)]:.1f} | {_ratio(pair[('ronde', n)], pair[('ddp', n)])} | "
                  f"{engine.get(('ronde', n), float('nan')):.1f} | "
                  f"{rounds.get(('ronde', n), float('nan')):.2f} | "
                  f"{wait[('single', 1)]:.2f} | {wait[('ronde', n)]:.2f} | "
                  f"{wait[('ddp', n)]:.2f} |")
            if ("autotune", n) in best:
                a = best[("autotune", n)]
                cells = [model_name, str(n), f"autotuned ronde: {a:.1f}",
                         f"autotuned/ronde {a / r:.2f}", f"autotuned/ddp {a / d:.2f}"]
                cells += [""] * 5 + [f"{cpu[('autotune', n)] - c1:.1f}"] + [""] * 3
                cells += [f"{pair[('autotune', n)]:.1f}"] + [""] * 7
                print("| " + " | ".join(cells) + " |")
    print("(samples/s; one thread per rank; best of rounds; efficiency = throughput(N) / "
          "(N x single); within cores: / (min(N, cores) x single); extra CPU = the "
          "process's CPU time per step (all threads, least of rounds) minus one process's; "
          "paired extra CPU: a library step's CPU beyond a plain one's in the same process, "
          "in turn (_paired; median of rounds; single's is the instrument's floor); "
          "ronde's threads: its own threads' CPU per step (control, executor, steady lane), mean of the "
          "ranks (part of its extra CPU; the rest is the training thread's); rounds/step: ronde's negotiation rounds per timed step, a count; GIL wait: how "
          "late a probe thread sleeping 1 ms at a time wakes, summed per step, mean of "
          "the ranks, least of rounds)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
