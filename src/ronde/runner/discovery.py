"""Where an elastic job's hosts come from: a fixed list, or a discovery script run again
and again (``ronderun --host-discovery-script``), bounded and reaped.

Where it sits: :class:`~ronde.runner.elastic_driver.ElasticDriver` asks
:meth:`Discovery.find` about once a second; the rules for the script's output are in
:class:`Discovery`'s docstring and docs/elastic.md.
"""

from __future__ import annotations

import logging
import os
import selectors
import shlex
import signal
import subprocess
import threading
import time

from .._errors import ConfigError
from .hosts import HostSpec, parse_host_item

log = logging.getLogger(__name__)

#: how often the discovery script runs
DISCOVER_EVERY_S = 1.0
#: the most bytes one line of the discovery script's output may have
DISCOVERY_LINE_LIMIT_BYTES = 4096
#: the most bytes of output (standard output) one run of the script may print
DISCOVERY_OUTPUT_LIMIT_BYTES = 1 << 20
#: the bytes of its standard error kept for the message of a run that failed
_STDERR_KEPT_BYTES = 4096


# -- discovery ---------------------------------------------------------------------------
class Discovery:
    """Where the hosts come from: a fixed list, or a script run again and again.

    The script runs on a thread of its own (about once a second), never in the driver's
    loop: a script that hangs or fails cannot delay failure handling. Each run has
    ``timeout_s`` (``DISCOVERY_TIMEOUT_S``); on expiry, or when its output passes
    :data:`DISCOVERY_OUTPUT_LIMIT_BYTES` or a line passes
    :data:`DISCOVERY_LINE_LIMIT_BYTES`, its whole process group is killed and reaped and
    the run fails with a message saying why. :meth:`close` (the job's end) does the
    same to a run in progress and waits for the thread. Each output line is ``host`` or
    ``host:slots`` (``[v6addr]:slots``); a line that is not UTF-8 or not a valid host
    name or address (:func:`~ronde.runner.hosts.valid_host_name`) is logged, naming it,
    and skipped; the others are used.
    """

    def __init__(self, fixed: list[HostSpec] | None = None, script: str | None = None,
                 slots_per_host: int = 1, timeout_s: float = 30.0) -> None:
        self.fixed, self.script, self.slots_per_host = fixed, script, slots_per_host
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._runs = 0  # finished runs
        self._hosts: list[HostSpec] | None = None  # from the newest run that succeeded
        self._error: str | None = None  # of the newest run, when it failed, until told
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[bytes] | None = None  # the run in progress

    @property
    def dynamic(self) -> bool:
        """Whether the hosts may change (the driver asks again about once a second)."""
        return self.script is not None

    def find(self) -> list[HostSpec]:
        """The hosts available now, as the newest run of the script found them (never
        waits, but for the first run); a ConfigError once for each run that failed."""
        if self.script is None:
            return list(self.fixed or [])
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ronde-discovery",
                                            daemon=True)
            self._thread.start()
        deadline = time.monotonic() + self.timeout_s + 5.0
        while True:
            with self._lock:
                runs, hosts, error = self._runs, self._hosts, self._error
                self._error = None
            if runs or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        if error is not None or hosts is None:
            raise ConfigError(error or f"--host-discovery-script {self.script}: no answer")
        return list(hosts)

    def close(self) -> None:
        """Stop running the script: a run in progress is killed (its process group) and
        reaped before this returns."""
        with self._lock:
            self._stop.set()
            proc = self._proc
        if proc is not None:  # the discovery thread reaps it and closes its pipes: closed
            _signal_group(proc)  # here, they were closed under its select() (EBADF)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10.0)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                hosts, error = self._run(), None
            except ConfigError as exc:
                hosts, error = None, str(exc)
            with self._lock:
                self._runs += 1
                if hosts is not None:
                    self._hosts = hosts
                self._error = error
            self._stop.wait(DISCOVER_EVERY_S)

    def _run(self) -> list[HostSpec]:
        """One run of the script (on the discovery thread)."""
        assert self.script is not None
        argv = [self.script] if os.path.isfile(self.script) else shlex.split(self.script)
        try:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            raise ConfigError(f"--host-discovery-script {self.script}: {exc}") from None
        with self._lock:
            self._proc = proc
            stopping = self._stop.is_set()
        try:
            if stopping:
                raise ConfigError(f"--host-discovery-script {self.script}: the job ended")
            out, err = self._read(proc)
            if self._stop.is_set():  # close() killed it: the output is cut short
                raise ConfigError(f"--host-discovery-script {self.script}: the job ended")
        finally:
            _kill_group(proc)
            with self._lock:
                self._proc = None
        if proc.returncode != 0:
            tail = err.decode("utf-8", "replace").strip()[-500:]
            raise ConfigError(f"--host-discovery-script {self.script} exited with "
                              f"{proc.returncode}: {tail}")
        hosts: list[HostSpec] = []
        for number, raw in enumerate(out.splitlines(), 1):
            where = f"line {number} of the output of {self.script}"
            try:
                line = raw.decode("utf-8").split("#", 1)[0].strip()
                if not line:
                    continue
                if " " in line or "\t" in line:
                    raise ConfigError(f"{where}: {line[:80]!r} is not 'host' or 'host:slots'")
                hosts.append(parse_host_item(line, where, self.slots_per_host))
            except (UnicodeDecodeError, ConfigError) as exc:
                log.warning("elastic: skipping %s (%r): %s", where, raw[:80], exc)
        return hosts

    def _read(self, proc: subprocess.Popen[bytes]) -> tuple[bytes, bytes]:
        """The run's standard output and the tail of its standard error, read until
        both close and the script exits; ConfigError past the timeout or the limits."""
        assert proc.stdout is not None and proc.stderr is not None
        deadline = time.monotonic() + self.timeout_s
        out, err = bytearray(), bytearray()
        line_start = 0
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ, out)
            sel.register(proc.stderr, selectors.EVENT_READ, err)
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._timed_out()
                if self._stop.is_set():
                    raise ConfigError(f"--host-discovery-script {self.script}: the job ended")
                for key, _ in sel.select(min(left, 0.5)):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    key.data.extend(chunk)
                    if key.data is err:
                        del err[:-_STDERR_KEPT_BYTES]
                        continue
                    if len(out) > DISCOVERY_OUTPUT_LIMIT_BYTES:
                        raise ConfigError(
                            f"--host-discovery-script {self.script} printed more than "
                            f"{DISCOVERY_OUTPUT_LIMIT_BYTES} bytes; killed it (print one "
                            "'host' or 'host:slots' a line)")
                    newline = out.rfind(b"\n", len(out) - len(chunk))
                    if newline >= 0:
                        line_start = newline + 1
                    if len(out) - line_start > DISCOVERY_LINE_LIMIT_BYTES:
                        number = out.count(b"\n", 0, line_start) + 1
                        raise ConfigError(
                            f"--host-discovery-script {self.script}: line {number} of "
                            "its output is longer "
                            f"than {DISCOVERY_LINE_LIMIT_BYTES} bytes; killed it (print one "
                            "'host' or 'host:slots' a line)")
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise self._timed_out() from None
        return bytes(out), bytes(err)

    def _timed_out(self) -> ConfigError:
        return ConfigError(f"--host-discovery-script {self.script} did not finish within "
                           f"{self.timeout_s:g}s; killed it and its children")


def _signal_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a discovery run's whole process group (what it started too, even once the
    script itself ended)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill a discovery run's whole process group, reap the script, and close its pipes
    (on the thread that reads them)."""
    _signal_group(proc)
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            try:
                pipe.close()
            except OSError:
                pass
