#!/usr/bin/env bash
# Start a real single-node Slurm (Debian's slurmctld + slurmd + munge) for the launcher tests.
#
#   eval "$(.ci/slurm-up.sh)"     # prints `export SLURM_CONF=...`; progress goes to stderr
#   .ci/slurm-down.sh             # stops only what this script started
#
# Idempotent: a second call finds the running daemons and prints the same line. Everything lives
# under SLURM_STATE_DIR (default /tmp/nvfp4-slurm): slurm.conf, spool, state, logs, pid files.
# Installs the packages when missing (needs root, ~5 s). No systemd, no cgroups: the node
# advertises SLURM_CPUS (default 4) CPUs whatever the machine has (SlurmdParameters=config_overrides).
set -euo pipefail
# Debian installs the daemons (and runuser) in sbin, which a non-login PATH may lack.
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"
STATE=${SLURM_STATE_DIR:-/tmp/nvfp4-slurm}
CONF=$STATE/slurm.conf
HOST=$(hostname -s)
say() { echo "slurm-up: $*" >&2; }
alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
    || ! command -v sinfo >/dev/null || ! command -v munged >/dev/null; then
  say "installing slurmctld slurmd slurm-client munge"
  # Keep the packages from starting services (docker images usually ship this file already).
  [[ -e /usr/sbin/policy-rc.d ]] || { printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
                                      chmod +x /usr/sbin/policy-rc.d; touch "/tmp/.nvfp4-policy-rc"; }
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >&2 \
    || { apt-get update -q >&2 && apt-get install -y -q --no-install-recommends \
           slurmctld slurmd slurm-client munge >&2; }
  [[ -e /tmp/.nvfp4-policy-rc ]] && rm -f /usr/sbin/policy-rc.d /tmp/.nvfp4-policy-rc
fi
mkdir -p "$STATE"/{state,spool,log}

# munge: reuse a running munged, else start one as user munge and remember that we did.
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  [[ -s /etc/munge/munge.key ]] || runuser -u munge -- /usr/sbin/mungekey --create >&2
  mkdir -p /run/munge && chown munge:munge /run/munge && chmod 755 /run/munge
  runuser -u munge -- /usr/sbin/munged
  cp /run/munge/munged.pid "$STATE/munged.pid"
  say "started munged ($(cat "$STATE/munged.pid"))"
fi

if ! alive "$STATE/slurmctld.pid"; then  # (re)write the config only while nothing uses it
  cat >"$CONF" <<EOF
ClusterName=nvfp4ci
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job may start again after cred_expire seconds (default 120): fast CI.
AuthInfo=cred_expire=${SLURM_CRED_EXPIRE:-5}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
KillWait=${SLURM_KILL_WAIT:-10}
# Fast turnaround for CI: sbatch --wait polls every <= MinJobAge/2 s (measured ~30 s otherwise),
# and a requeued job starts within ~2 s of its BeginTime (the main loop runs every 60 s otherwise).
MinJobAge=15
SchedulerParameters=bf_interval=1,sched_interval=2
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=${SLURM_CPUS:-4} State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
fi
export SLURM_CONF=$CONF
alive "$STATE/slurmctld.pid" || { slurmctld -c -f "$CONF"; say "started slurmctld"; }
alive "$STATE/slurmd.pid" || { slurmd -N "$HOST" -f "$CONF"; say "started slurmd"; }

for _ in $(seq 100); do  # ~1 s in practice
  state=$(sinfo -h -N -o %t 2>/dev/null || true)
  [[ $state == idle* || $state == mix* || $state == alloc* ]] && break
  sleep 0.2
done
[[ $state == idle* || $state == mix* || $state == alloc* ]] \
  || { say "node not idle (state '${state:-none}'); logs in $STATE/log"; exit 1; }
say "node $HOST $state"
echo "export SLURM_CONF=$CONF"
