"""Start the workers of one job, relay their output, and stop them all on the first failure.

:func:`run` is the Python API behind ``ronderun``. It resolves the rank layout
(:mod:`ronde.runner.hosts`), starts a :class:`~ronde.runner.rendezvous.RendezvousServer`
with a fresh per-job secret, starts one process per rank (local ranks directly, in
their own process group; remote ranks through the remote shell, ``ssh`` by default),
and prefixes every output line with the rank. As soon as one worker exits non-zero,
the others are stopped (SIGTERM to each process group, SIGKILL after a grace period)
and the job's exit code is the *first* failure's: the earliest rank that reported a
primary failure to the rendezvous service, else the earliest non-zero exit.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any, Mapping, Sequence

from .._config import setting
from .._errors import ConfigError
from .._text import ranks_text
from .env import torchrun_env, worker_env_vars
from .hosts import is_local, layout
from ..transport.net import route_address
from . import summary, zygote
from .rendezvous import RendezvousServer
from .workers import Worker as _Worker, remote_worker

log = logging.getLogger(__name__)

#: Seconds between SIGTERM and SIGKILL when stopping workers (``RONDE_STOP_GRACE``): a
#: rank inside ``save_checkpoint`` finishes its file first; the others die at SIGTERM.
GRACE_S = 10.0


def stop_grace_s() -> float:
    """``RONDE_STOP_GRACE`` (seconds, 0 to 3600), else :data:`GRACE_S`."""
    value = setting("stop_grace_s")
    return GRACE_S if value is None else float(value)  # type: ignore[arg-type]


#: after a failure, how long survivors may take to exit by themselves before SIGTERM
SETTLE_S = 1.0
_PARTIAL_LINE_LIMIT = 1 << 16


@dataclasses.dataclass
class LaunchResult:
    """How a job ended.

    Attributes:
        returncode: the launcher's exit code: 0, the first failed rank's code (a signal
            death ``-N`` maps to ``128+N``), 124 on ``timeout_s``, 130/143 when the
            launcher got SIGINT/SIGTERM.
        first_failed_rank: the rank that failed first, or None.
        exit_codes: each rank's raw exit status (negative: killed by that signal;
            None: never started).
        cause: one line saying why the job ended.
        summary: the summary text printed to stderr at the end ("" on success).
    """

    returncode: int
    first_failed_rank: int | None
    exit_codes: list[int | None]
    cause: str
    summary: str = ""


class _Job:
    def __init__(self, workers: list[_Worker], stdout: IO[str], stderr: IO[str],
                 output_dir: str | None, timeout_s: float | None,
                 server: RendezvousServer, zygote_: zygote.Zygote | None = None) -> None:
        self.workers = workers
        #: the process local workers are forked from (``preload``), or None
        self.zygote = zygote_
        self.stdout, self.stderr = stdout, stderr
        self.output_dir = output_dir
        self.timeout_s = timeout_s
        self.server = server
        self.events: queue.Queue[tuple[int, int, float]] = queue.Queue()
        self.out_lock = threading.Lock()
        self.signals: list[int] = []
        self.grace_s = stop_grace_s()

    # -- output ------------------------------------------------------------------
    def _emit(self, stream: IO[str], prefix: str, data: bytes, w: _Worker | None) -> None:
        text = data.decode("utf-8", errors="replace")
        if text.endswith("\r"):
            text = text[:-1]
        if w is not None:
            w.tail.append(text)
        line = f"{prefix}{text}\n"
        with self.out_lock:
            try:
                stream.write(line)
                stream.flush()
            except UnicodeEncodeError:
                enc = getattr(stream, "encoding", None) or "ascii"
                stream.write(line.encode(enc, "replace").decode(enc))
                stream.flush()
            except (OSError, ValueError):  # closed or broken stream: keep draining the pipe
                pass

    def _pump(self, w: _Worker, pipe: IO[bytes], kind: str) -> None:
        stream = self.stdout if kind == "stdout" else self.stderr
        prefix = f"[{w.slot.rank}]<{kind}>:"
        tail_owner = w if kind == "stderr" else None
        copy = None
        if self.output_dir is not None:
            path = os.path.join(self.output_dir, f"rank.{w.slot.rank}", kind)
            try:
                copy = open(path, "wb")
            except OSError as exc:  # keep relaying (and draining the pipe) regardless
                log.warning("cannot write %s: %s", path, exc)
        buf = b""
        try:
            while True:
                chunk = os.read(pipe.fileno(), 65536)
                if not chunk:
                    break
                if copy is not None:
                    copy.write(chunk)
                    copy.flush()
                buf += chunk
                *lines, buf = buf.split(b"\n")
                if len(buf) > _PARTIAL_LINE_LIMIT:  # a huge line without newline
                    lines.append(buf)
                    buf = b""
                for line in lines:
                    self._emit(stream, prefix, line, tail_owner)
            if buf:
                self._emit(stream, prefix, buf, tail_owner)
        except OSError:
            pass
        finally:
            pipe.close()
            if copy is not None:
                copy.close()

    # -- processes ---------------------------------------------------------------
    def _wait(self, w: _Worker) -> None:
        assert w.proc is not None
        code = w.proc.wait()
        self.events.put((w.slot.rank, code, time.monotonic()))

    def _spawn(self, w: _Worker) -> None:
        """Start one worker with a lifeline: a pipe the launcher holds open and never
        writes. A local worker inherits its read end (``RONDE_LAUNCHER_FD``); a remote
        one's is its standard input, after the secret's line. When the launcher dies,
        even by SIGKILL, the pipe closes and the worker stops itself (runner/lifeline.py)."""
        try:
            if w.stdin_line is None:
                r, keep = os.pipe()
                try:
                    w.proc = self._fork(w, r)
                    if w.proc is None:
                        env = {**w.env, "RONDE_LAUNCHER_FD": f"{r}:{os.fstat(r).st_ino}"}
                        w.proc = subprocess.Popen(
                            w.argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, pass_fds=(r,))
                except BaseException:
                    os.close(keep)
                    raise
                finally:
                    os.close(r)
                w.lifeline = keep
            else:
                w.proc = subprocess.Popen(
                    w.argv, env=w.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, start_new_session=True)
                assert w.proc.stdin is not None
                w.lifeline = os.dup(w.proc.stdin.fileno())
                w.proc.stdin.close()
                try:
                    os.write(w.lifeline, (w.stdin_line + "\n").encode())
                except OSError:
                    pass  # it died at once: its exit code tells
        except OSError as exc:
            msg = f"ronderun: cannot start rank {w.slot.rank} ({shlex.join(w.argv[:1])}): {exc}"
            self._emit(self.stderr, f"[{w.slot.rank}]<stderr>:", msg.encode(), w)
            w.returncode, w.exit_time = 127, time.monotonic()
            self.events.put((w.slot.rank, 127, w.exit_time))
            return
        assert w.proc.stdout is not None and w.proc.stderr is not None
        for target, args, name in ((self._pump, (w, w.proc.stdout, "stdout"), "out"),
                                   (self._pump, (w, w.proc.stderr, "stderr"), "err"),
                                   (self._wait, (w,), "wait")):
            t = threading.Thread(target=target, args=args, daemon=True,
                                 name=f"ronderun-{name}-{w.slot.rank}")
            t.start()
            w.threads.append(t)

    def _fork(self, w: _Worker, lifeline: int) -> zygote.ZygoteProcess | None:
        """The worker forked from this job's zygote (``preload``), or None: no zygote, a
        command it cannot run (:func:`zygote.eligible`), or the zygote gone."""
        if self.zygote is None or not zygote.eligible(w.argv):
            return None
        try:
            return self.zygote.spawn(w.argv, w.env, os.getcwd(), lifeline)
        except (zygote.ZygoteUnavailable, OSError) as exc:
            log.warning("ronderun: rank %d starts without the zygote: %s", w.slot.rank, exc)
            return None

    def _record(self, block_s: float) -> None:
        try:
            rank, code, when = self.events.get(timeout=block_s)
        except queue.Empty:
            return
        w = self.workers[rank]
        w.returncode, w.exit_time = code, when
        if w.signalled or code != 0:
            w.killpg(signal.SIGKILL)  # leftovers of a stopped or failed worker's group

    def _reporters(self) -> set[int]:
        """Ranks that reported a primary failure of their own to the rendezvous service."""
        return {f["rank"] for f in summary.primary_reports(list(self.server.failures))}

    def _stop_all(self, spare_reporters: bool = False) -> None:
        """SIGTERM every live worker's group, SIGKILL after the grace period.

        With ``spare_reporters``, ranks that reported their own failure get the grace
        period to exit by themselves (and keep their exit code) before the SIGKILL.
        """
        spared = self._reporters() if spare_reporters else set()
        for w in self.workers:
            if w.alive and w.slot.rank not in spared:
                w.signalled = True
                w.killpg(signal.SIGTERM)
        n_signals = len(self.signals)
        deadline = time.monotonic() + self.grace_s
        while any(w.alive for w in self.workers) and time.monotonic() < deadline:
            if len(self.signals) > n_signals:  # a second Ctrl-C: do not wait any longer
                break
            self._record(0.05)
        self._kill_all()

    def _kill_all(self) -> None:
        for w in self.workers:
            if w.alive:
                w.signalled = True
                w.killpg(signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while any(w.alive for w in self.workers) and time.monotonic() < deadline:
            self._record(0.05)
        for w in self.workers:
            if w.lifeline is not None and not w.alive:
                os.close(w.lifeline)
                w.lifeline = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signals.append(signum)

    def _catch_signals(self) -> dict[int, Any]:
        """SIGINT/SIGTERM recorded (main thread only); returns the handlers to restore."""
        restore: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                restore[signum] = signal.signal(signum, self._on_signal)
        return restore

    # -- the job -----------------------------------------------------------------
    def run(self) -> LaunchResult:
        restore = self._catch_signals()
        reason = ""
        start = time.monotonic()
        try:
            for w in self.workers:
                self._spawn(w)
                if self.signals:
                    break
            while True:
                self._record(0.1)
                if self.signals:
                    reason = "signal"
                elif any(w.returncode not in (None, 0) for w in self.workers):
                    reason = "failure"
                elif all(w.returncode is not None for w in self.workers):
                    reason = "done"
                elif self.timeout_s is not None and time.monotonic() - start > self.timeout_s:
                    reason = "timeout"
                if reason:
                    break
            if reason == "failure":
                # Give the survivors a moment to fail by themselves: their own typed
                # errors (PeerLostError naming the lost rank...) are worth showing.
                settle = time.monotonic() + SETTLE_S
                while any(w.alive for w in self.workers) and time.monotonic() < settle \
                        and not self.signals:
                    self._record(0.05)
            running = [w.slot.rank for w in self.workers if w.alive]
            if reason != "done":
                self._stop_all(spare_reporters=reason == "failure")
        finally:
            self._kill_all()  # never leave a worker behind, whatever happened above
            for num, old in restore.items():
                signal.signal(num, old)
        for w in self.workers:
            for t in w.threads:
                t.join(timeout=2.0)
        return self._result(reason, running)

    def _result(self, reason: str, running: list[int]) -> LaunchResult:
        codes = [w.returncode for w in self.workers]
        if reason == "done":
            return LaunchResult(0, None, codes, "all ranks exited with code 0")
        if reason == "signal":
            sig = self.signals[0]
            code = 130 if sig == signal.SIGINT else 128 + sig
            cause = (f"interrupted by {signal.Signals(sig).name}; stopped rank(s) "
                     f"{ranks_text(running) or 'none'}")
            return self._finish(LaunchResult(code, None, codes, cause), [f"ronderun: {cause}"])
        if reason == "timeout":
            cause = (f"job timed out after {self.timeout_s:g}s (--timeout); killed the ranks "
                     f"still running: {ranks_text(running) or 'none'}")
            return self._finish(LaunchResult(124, None, codes, cause), [f"ronderun: {cause}"])
        first, message = summary.first_failure(self.workers, list(self.server.failures))
        assert first is not None
        code, cause, lines = summary.failure_lines(first, message, self.workers)
        return self._finish(LaunchResult(code, first.slot.rank, codes, cause), lines)

    def _finish(self, result: LaunchResult, lines: list[str]) -> LaunchResult:
        result.summary = "\n".join(lines)
        tty = bool(getattr(self.stderr, "isatty", lambda: False)())
        if tty:
            lines = [f"\x1b[1;31m{lines[0]}\x1b[0m", *lines[1:]]
        with self.out_lock:
            try:
                self.stderr.write("\n".join(lines) + "\n")
                self.stderr.flush()
            except (OSError, ValueError):
                pass
        return result


def _masked(argv: list[str], secret_hex: str) -> str:
    return shlex.join(argv).replace(secret_hex, "<secret>")


def run(command: Sequence[str], np: int | None, hosts: str | None = None,
        hostfile: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None,
        start_timeout_s: float = 30.0, output_dir: str | os.PathLike[str] | None = None,
        verbose: bool = False, timeout_s: float | None = None, ssh_port: int | None = None,
        ssh_identity: str | None = None, stdout: IO[str] | None = None,
        stderr: IO[str] | None = None,
        extra_worker_env: Mapping[str, str] | None = None,
        preload: Sequence[str] = ()) -> LaunchResult:
    """Run ``command`` as ``np`` ranks and wait for all of them.

    Args:
        command: the worker command line, e.g. ``["python", "train.py"]``.
        np: number of ranks; None uses every slot of ``hosts``/``hostfile``.
        hosts: ``-H`` value (``"host1:2,host2:2"``); without hosts all ranks run here.
        hostfile: path of a hostfile (``host slots=N`` lines); exclusive with ``hosts``.
        env: variables set for every worker, local and remote (``ronderun -x``).
        start_timeout_s: how long ranks may take to reach the rendezvous.
        output_dir: if set, each rank's raw output also goes to
            ``output_dir/rank.<N>/stdout`` and ``.../stderr``.
        verbose: print the rank layout and the worker commands to ``stderr`` at start.
        timeout_s: wall-clock limit for the whole job; on expiry all ranks are killed
            and the return code is 124.
        ssh_port: port for the default ssh remote shell.
        ssh_identity: identity file for the default ssh remote shell.
        stdout: where prefixed worker stdout goes (default: ``sys.stdout`` at call time).
        stderr: where prefixed worker stderr and the summary go (default ``sys.stderr``).
        extra_worker_env: more variables for every worker, applied after ``env``.
        preload: modules to import once in a zygote process that forks the local
            workers (``runner/zygote.py``; kept for this process's later launches); a
            worker it cannot run starts as usual.

    Returns:
        A :class:`LaunchResult`; its ``returncode`` is what ``ronderun`` exits with.

    Raises:
        ConfigError: on an empty command or a bad host specification.
    """
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    command = list(command)
    if not command:
        raise ConfigError("no command given; write e.g. ronderun -np 2 python train.py")
    slots = layout(np, hosts, hostfile)
    local = {s.host: is_local(s.host) for s in slots}
    all_local = all(local.values())
    bind_env = str(setting("bind_addr") or "")  # checked: an address or a name that resolves
    if all_local:
        advertise = "127.0.0.1"
    elif bind_env and bind_env not in ("0.0.0.0", "::"):
        advertise = bind_env
    else:
        advertise = route_address(next(h for h, loc in local.items() if not loc))
    # the address the workers are told, never every interface unless asked
    bind = "127.0.0.1" if all_local else (bind_env or advertise)
    secret = secrets.token_bytes(32)
    job_id = f"ronde-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        server = RendezvousServer(len(slots), secret, host=bind, start_timeout_s=start_timeout_s)
    except OSError as exc:
        raise ConfigError(f"the rendezvous service cannot listen on {bind}: {exc.strerror}; "
                          "check --bind-addr / RONDE_BIND_ADDR") from None
    try:
        server.start()
        wanted = setting("torchrun_env", {**os.environ, **(env or {})})
        torch_env = (torchrun_env(slots, advertise, env) if wanted is not False
                     else [{} for _ in slots])
        workers = []
        for s in slots:
            variables = worker_env_vars(
                rank=s.rank, size=len(slots), local_rank=s.local_rank, local_size=s.local_size,
                cross_rank=s.cross_rank, cross_size=s.cross_size, host=s.host,
                rendezvous=(advertise, server.port), secret=secret, job_id=job_id)
            variables["PYTHONUNBUFFERED"] = "1"
            variables.update(torch_env[s.rank])
            variables.update(env or {})
            variables.update(extra_worker_env or {})
            variables["RONDE_START_TIMEOUT"] = f"{start_timeout_s:g}"
            if local[s.host]:
                shown = ["env", *(f"{k}={v}" for k, v in variables.items()), *command]
                workers.append(_Worker(s, command, {**os.environ, **variables}, shown))
            else:
                workers.append(remote_worker(s, s.host, command, variables, ssh_port,
                                             ssh_identity))
        if verbose:
            lines = [f"ronderun: job {job_id}, {len(slots)} rank(s), rendezvous "
                     f"{advertise}:{server.port} (bound to {bind})"]
            for w in workers:
                s = w.slot
                how = "local" if local[s.host] else "remote"
                lines.append(f"ronderun: rank {s.rank} on {s.host} ({how}): local "
                             f"{s.local_rank}/{s.local_size}, cross {s.cross_rank}/{s.cross_size}")
                lines.append(f"ronderun:   {_masked(w.shown, secret.hex())}")
            stderr.write("\n".join(lines) + "\n")
            stderr.flush()
        out_dir = os.fspath(output_dir) if output_dir else None
        try:
            for s in slots if out_dir is not None else []:
                os.makedirs(os.path.join(out_dir or "", f"rank.{s.rank}"), exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--output-filename {out_dir}: cannot create the rank "
                              f"folders there ({exc.strerror})") from None
        zyg = (zygote.zygote_for(preload, {**os.environ, **(env or {})})
               if preload and any(local.values()) else None)
        job = _Job(workers, stdout, stderr, out_dir, timeout_s, server, zyg)
        return job.run()
    finally:
        server.close()
        # segments are unlinked once mapped; this catches a crash during start-up
        from ..transport.segments import remove_job_segments

        remove_job_segments(job_id)
