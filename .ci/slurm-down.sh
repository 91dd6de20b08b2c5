#!/usr/bin/env bash
# Stop what .ci/slurm-up.sh started (by the pid files it wrote), nothing else. Idempotent.
set -uo pipefail
STATE=${SLURM_STATE_DIR:-/tmp/nvfp4-slurm}
[[ -e $STATE/slurm.conf ]] && SLURM_CONF=$STATE/slurm.conf scancel --full --user="$(id -un)" 2>/dev/null
for name in slurmd slurmctld munged; do
  pidfile=$STATE/$name.pid
  [[ -s $pidfile ]] || continue
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
    echo "slurm-down: stopped $name ($pid)" >&2
  fi
  rm -f "$pidfile"
done
# The state (slurm.conf, logs) stays for inspection; slurmctld -c starts clean next time.
exit 0
