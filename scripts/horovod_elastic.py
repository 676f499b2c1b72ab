"""Horovod's elastic integration scenarios, run on ronde with Horovod's own training script.

    python scripts/horovod_elastic.py /path/to/horovod [scenario ...]

Horovod's ``test/integration/data/elastic_torch_main.py`` is run unchanged under
``ronderun`` (through ``python -m ronde.compat``, so ``import horovod.torch`` means
ronde) in the scenarios of Horovod's ``test/integration/elastic_common.py``: hosts added
and removed on a schedule, one rank failing by exception or by SIGKILL, fault tolerance
with a fixed host list, every rank failing, every host blacklisted, too few hosts, the
reset limit. The discovery script follows Horovod's schedule format (epoch -> hosts,
driven by the number of lines in the training script's log). Prints one line per
scenario with what it checked; exits non-zero if any failed. Needs psutil (the
training script imports it) and torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

TIMEOUT_S = 180


def _discovery_script(path: str, logfile: str, schedule: list) -> None:
    lines = ["#!/bin/bash", "epoch=0", f'[ -f {logfile} ] && epoch=$(wc -l < {logfile} | tr -d " ")']
    for i, (epoch, hosts) in enumerate(schedule):
        echo = "\n".join(f'echo "{h}"' for h in hosts)
        if len(schedule) == 1:
            lines.append(echo)
        elif i == 0:
            lines += [f'if [ "$epoch" == "{epoch}" ]; then', echo]
        elif i < len(schedule) - 1:
            lines += [f'elif [ "$epoch" == "{epoch}" ]; then', echo]
        else:
            lines += ["else", echo, "fi"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.chmod(path, 0o755)


def run(horovod: str, schedule=None, hosts=None, exit_schedule=None, exit_mode="exception",
        np=2, min_np=2, max_np=4, reset_limit=None, cooldown=None, epochs=None,
        epoch_wait=None):
    script = os.path.join(horovod, "test/integration/data/elastic_torch_main.py")
    with tempfile.TemporaryDirectory() as tmp:
        logfile = os.path.join(tmp, "log.txt")
        discovery = os.path.join(tmp, "discover.sh")
        _discovery_script(discovery, logfile, schedule or [(None, hosts.split(","))])
        cmd = ["ronderun", "-np", str(np), "--min-num-proc", str(min_np)]
        cmd += ["-H", hosts] if hosts else ["--host-discovery-script", discovery,
                                            "--max-num-proc", str(max_np)]
        if reset_limit is not None:
            cmd += ["--reset-limit", str(reset_limit)]
        if cooldown:
            cmd += ["--blacklist-cooldown-range", str(cooldown[0]), str(cooldown[1])]
        cmd += ["python", "-m", "ronde.compat", script, "--logfile", logfile]
        if schedule:
            cmd += ["--discovery-schedule", json.dumps(schedule)]
        if exit_schedule:
            cmd += ["--exit-schedule", json.dumps(exit_schedule), "--exit-mode", exit_mode]
        if epochs:
            cmd += ["--epochs", str(epochs)]
        if epoch_wait:
            cmd += ["--epoch-wait", str(epoch_wait)]
        env = dict(os.environ, RONDE_ELASTIC_TIMEOUT=os.environ.get("RONDE_ELASTIC_TIMEOUT", "10"))
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
        results = []
        if os.path.exists(logfile):
            with open(logfile) as f:
                results = [json.loads(line) for line in f if line.strip()]
        return proc.returncode, results, proc.stdout + proc.stderr


def _facts(results, expected):
    got = [{k: r[k] for k in e} for r, e in zip(results, expected)]
    return len(results) == len(expected) and got == expected, got


def scenarios(horovod):
    out = {}
    for slots in (2, 1):
        sched = [(0, [f"localhost:{slots}"]), (1, [f"localhost:{slots}", f"127.0.0.1:{slots}"]),
                 (None, [f"127.0.0.1:{slots}"])]
        rc, res, text = run(horovod, sched, np=slots, min_np=slots, max_np=2 * slots)
        ok, got = _facts(res, [
            {"start_rank": 0, "size": slots, "hostname": "localhost"},
            {"start_rank": 0, "size": 2 * slots, "hostname": "localhost"},
            {"start_rank": slots, "size": slots, "hostname": "127.0.0.1", "rendezvous": 3}])
        out[f"hosts_added_and_removed[slots={slots}]"] = (ok and rc == 0, got, text)
    expected_failure = [{"start_rank": 0, "size": 4, "rendezvous": 1},
                        {"start_rank": 2, "size": 2, "rendezvous": 2},
                        {"start_rank": 2, "size": 2, "rendezvous": 2}]
    for mode in ("exception", "kill"):
        rc, res, text = run(horovod, [(None, ["localhost:2", "127.0.0.1:2"])],
                            exit_schedule={str((1, 0)): [0]}, exit_mode=mode)
        ok, got = _facts(res, expected_failure)
        out[f"single_rank_failure[{mode}]"] = (ok and rc == 0, got, text)
        rc, res, text = run(horovod, hosts="localhost:2,127.0.0.1:2",
                            exit_schedule={str((1, 0)): [0]}, exit_mode=mode)
        ok, got = _facts(res, expected_failure)
        out[f"fault_tolerance_without_scaling[{mode}]"] = (ok and rc == 0, got, text)
    rc, res, text = run(horovod, [(None, ["localhost:2", "127.0.0.1:2"])],
                        exit_schedule={str((1, 0)): [0, 1, 2, 3]})
    out["all_ranks_failure"] = (rc != 0, f"rc={rc}", text)
    rc, res, text = run(horovod, [(None, ["localhost:2", "127.0.0.1:2"])],
                        exit_schedule={str((1, 0)): [0, 2]})
    out["all_hosts_blacklisted"] = (rc != 0, f"rc={rc}", text)
    rc, res, text = run(horovod, [(None, ["localhost:2", "127.0.0.1:2"])],
                        exit_schedule={str((1, 0)): [0]}, np=4, min_np=4)
    out["min_hosts_timeout"] = (rc != 0, f"rc={rc}", text)
    sched = [(0, ["localhost:2"]), (1, ["localhost:2", "127.0.0.1:2"]), (None, ["127.0.0.1:2"])]
    rc1, _, text1 = run(horovod, sched, reset_limit=1)
    rc2, res2, text2 = run(horovod, sched, reset_limit=2)
    out["reset_limit"] = (rc1 != 0 and "reset-limit" in text1 and rc2 == 0 and len(res2) == 3,
                          f"limit 1: rc={rc1}; limit 2: rc={rc2}, {len(res2)} epochs", text1 + text2)
    return out


def main(argv):
    horovod, wanted = argv[0], set(argv[1:])
    failed = 0
    for name, (ok, got, text) in scenarios(horovod).items():
        if wanted and not any(w in name for w in wanted):
            continue
        print(f"{'PASS' if ok else 'FAIL'} {name}: {got}")
        if not ok:
            failed += 1
            print("    " + "\n    ".join(text.splitlines()[-25:]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
