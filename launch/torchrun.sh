#!/usr/bin/env bash
# Run train.py under torchrun, on one node or many; Hydra overrides pass through.
#
#   launch/torchrun.sh trainer.max_steps=50                       # this node, NPROC_PER_NODE ranks
#   NPROC_PER_NODE=8 RUN_DIR=/ckpt/runs/a launch/torchrun.sh parallel=tp2 precision=nvfp4
#   # every node, same values:  (launch/slurm.sbatch does this for you)
#   NNODES=4 NPROC_PER_NODE=8 RDZV_ENDPOINT=node0:29500 RDZV_ID=run-a RUN_DIR=/shared/runs/a \
#     launch/torchrun.sh precision=nvfp4
#
# Knobs (environment):
#   NPROC_PER_NODE  ranks on this node            (default: the GPUs nvidia-smi lists, else 1)
#   NNODES          nodes (c10d rendezvous)       (default 1)
#   RDZV_ENDPOINT   host:port of the rendezvous   (default localhost:0 = a free port, one node)
#   RDZV_ID         rendezvous id, equal on all nodes (default $SLURM_JOB_ID, else "nvfp4")
#   NODE_RANK       fixed node rank               (default: assigned by the rendezvous)
#   RUN_DIR         the run directory of every rank -> run.dir=<absolute path>, and torchrun's
#                   per-rank logs in RUN_DIR/logs (default: train.py's runs/<run.name>)
#   LOG_RANK        local ranks shown on the console (default 0; "0,1" or "" for all)
#   SHUTDOWN_TIMEOUT seconds the trainers get to checkpoint after a signal before SIGKILL (300)
#   CUDA_DEVICE_MAX_CONNECTIONS  exported as 1 unless set (what megatron's TP overlap relies on)
#   PYTHON          interpreter (default: the repo's .venv/bin/python, else python3)
#
# Exit code: train.py's (the first rank to fail), 0 when every rank finished. SIGTERM, SIGUSR1 or
# a first Ctrl-C (SIGINT) to this script (or to the trainers) makes every trainer finish its step,
# checkpoint and exit 75 (preempted); the script then exits 75 and `run.resume=auto` continues the
# run next time. A second Ctrl-C stops the trainers at once (130).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-$( [[ -x $REPO/.venv/bin/python ]] && echo "$REPO/.venv/bin/python" || echo python3)}
export SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-300}
# megatron's tensor-parallel linears start their sequence-parallel all-gather / reduce-scatter
# before the GEMM that must wait for it and "rely on CUDA_DEVICE_MAX_CONNECTIONS=1" (one hardware
# queue) for the order (mc 0.16.1 tensor_parallel/layers.py:526,545,558; core_v0.19.0 :621,640,653);
# its examples/mamba/train.sh:32 exports it; not needed from Blackwell on (core_v0.19.0
# training/arguments.py:1412-1415), nor at TP=1, where it costs nothing. A value you set wins
# (megatron's FSDP, not used here, wants it > 1).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
NPROC_PER_NODE=${NPROC_PER_NODE:-$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)}
args=(--nnodes "${NNODES:-1}" --nproc-per-node "$(( NPROC_PER_NODE > 0 ? NPROC_PER_NODE : 1 ))"
      --rdzv-backend c10d --rdzv-endpoint "${RDZV_ENDPOINT:-localhost:0}"
      --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-nvfp4}}" --max-restarts 0
      --local-ranks-filter "${LOG_RANK-0}" --tee 3 --shutdown-timeout "$SHUTDOWN_TIMEOUT"
      --signals-to-handle SIGHUP,SIGQUIT)  # SIGTERM/SIGUSR1/SIGINT: handled below
[[ -n ${NODE_RANK:-} ]] && args+=(--node-rank "$NODE_RANK")
overrides=()
if [[ -n ${RUN_DIR:-} ]]; then
  RUN_DIR=$(realpath -m "$RUN_DIR")
  args+=(--log-dir "$RUN_DIR/logs")
  overrides=("run.dir=$RUN_DIR")
fi
cd "$REPO"
# torchrun itself answers SIGTERM with SIGTERM-then-SIGKILL to the workers and exits 1 whatever
# they returned. This agent passes SIGTERM/SIGUSR1/SIGINT on to the trainers (each in a session of
# its own: a terminal's Ctrl-C reaches them only this way, once), keeps watching them (SIGKILL
# after SHUTDOWN_TIMEOUT) and exits with the first failing rank's code: 75 after a preemption.
exec "$PYTHON" -c '
import os, signal, sys, threading, psutil
from torch.distributed.run import main
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
def to_workers(signum):
    for child in psutil.Process().children():
        try: child.send_signal(signum)
        except psutil.NoSuchProcess: pass
def forward(signum, _frame):
    to_workers(signum)
    kill = threading.Timer(float(os.environ["SHUTDOWN_TIMEOUT"]), to_workers, [signal.SIGKILL])
    kill.daemon = True
    kill.start()
for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
    signal.signal(sig, forward)
try:
    main(sys.argv[1:])
    code = 0
except ChildFailedError as err:
    code = err.get_first_failure()[1].exitcode
sys.stdout.flush(); sys.stderr.flush()  # exit now: no interpreter teardown for a late signal to hit
os._exit(code if code >= 0 else 128 - code)
' "${args[@]}" train.py "${overrides[@]}" "$@"
