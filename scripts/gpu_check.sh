#!/usr/bin/env bash
# The GPU checks, as one prepared run on a machine with a CUDA GPU and a python3 that
# has torch with CUDA (numpy, pytest and pytest-timeout too); nothing is installed.
#   bash scripts/gpu_check.sh [LOG_DIR]
# 1. what the machine has; 2. whether NCCL accepts two ranks on one GPU (raw torch,
# no ronde); 3. the gpu-marked tests; 4. the engine alone, then the CUDA benchmark at
# np=1 and np=2; 5. the README's PyTorch example on the GPU at np=1 and np=2.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-.}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
RUN="$PY -m ronde.runner.cli"
rc=0
step() { echo; echo "=== $*"; }

step machine
nvidia-smi -L || true
$PY -c 'import torch, numpy; print("torch", torch.__version__, "cuda", torch.version.cuda,
"gpus", torch.cuda.device_count(), "numpy", numpy.__version__)
print("nccl", torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None)'

step "raw NCCL, two ranks on GPU 0 (no ronde)"
timeout 90 $PY - <<'PY' || echo "raw NCCL probe exited with $?"
import datetime, os, torch, torch.distributed as dist, torch.multiprocessing as mp

def worker(rank, port):
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=30))
    torch.cuda.set_device(0)
    try:
        dist.init_process_group("nccl", store=store, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=30),
                                device_id=torch.device("cuda", 0))
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        print(f"rank {rank}: NCCL allreduce on a shared GPU gave {t.tolist()}", flush=True)
        dist.destroy_process_group()
    except Exception as e:  # what NCCL says is the finding
        print(f"rank {rank}: {type(e).__name__}: {str(e)[:300]}", flush=True)

if __name__ == "__main__":
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    # fork: the parent never touched CUDA, and a script on stdin cannot be spawned
    mp.start_processes(worker, args=(port,), nprocs=2, start_method="fork")
PY

step "gpu tests"
timeout 300 $PY -m pytest -q -m gpu -p no:cacheprovider tests/torch/test_torch_cuda.py -rA 2>&1 \
  | tee "$LOG/gpu_tests.log" | tail -40
[ "${PIPESTATUS[0]}" = 0 ] || rc=1

step "the engine alone on this machine: numpy allreduce at np=2 over shm (no GPU)"
timeout 90 $PY -m ronde.bench allreduce --sizes 4B,1MiB,16MiB,64MiB --rounds 1 \
  --transports shm --peers none 2>&1 | tail -8

for np_ in 1 2; do
  step "benchmark, np=$np_"
  timeout 120 $RUN -np $np_ $PY -m ronde.bench.cuda 2>&1 | tee "$LOG/bench_np$np_.log" \
    | grep -v '^\[[1-9]'
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
done
for np_ in 1 2; do
  step "the README's PyTorch example on the GPU, np=$np_"
  timeout 120 $RUN -np $np_ $PY examples/pytorch_mnist.py --checkpoint /tmp/ckpt.pt 2>&1 \
    | grep -E "test accuracy|share one GPU|Error" | head -5
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
done
echo "gpu_check rc=$rc"
exit $rc
