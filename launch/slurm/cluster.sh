#!/bin/bash
# A real one-node SLURM cluster on this machine (slurmctld + slurmd + munge; CPUs are the
# only resource), to run launch/slurm/*.sbatch for real without a cluster.
#
#   apt-get install -y slurm-wlm munge          # Debian 12: SLURM 22.05
#   launch/slurm/cluster.sh up                  # prints `export SLURM_CONF=...`
#   export SLURM_CONF=/tmp/hetjax-slurm/slurm.conf
#   sinfo; sbatch ...; squeue; scancel ...
#   launch/slurm/cluster.sh down
#
# Runs as root (SlurmUser=root), keeps everything under SLURM_DIR, and uses no cgroups
# (proctrack/linuxproc, task/none): it works inside a container. The node claims CPUS
# CPUs whatever the machine has (SlurmdParameters=config_overrides), so that a job of
# several tasks fits on a small machine; the tasks then share its real cores.
#
# Settings (environment): SLURM_DIR [/tmp/hetjax-slurm], CPUS [8], SLURM_WAIT_S [30].

set -euo pipefail

SLURM_DIR="${SLURM_DIR:-/tmp/hetjax-slurm}"
CPUS="${CPUS:-8}"
SLURM_WAIT_S="${SLURM_WAIT_S:-30}"
NODE="$(hostname -s)"
CONF="$SLURM_DIR/slurm.conf"

fail() { echo "cluster.sh: error: $*" >&2; exit 2; }

up() {
  for tool in slurmctld slurmd munged sinfo; do
    command -v "$tool" >/dev/null || [[ -x "/usr/sbin/$tool" ]] \
      || fail "$tool is not installed; apt-get install -y slurm-wlm munge"
  done
  [[ "$CPUS" =~ ^[1-9][0-9]*$ ]] || fail "CPUS='$CPUS': give a number of CPUs, e.g. 8"
  if [[ -s "$SLURM_DIR/slurmctld.pid" ]] && kill -0 "$(cat "$SLURM_DIR/slurmctld.pid")" 2>/dev/null \
     && SLURM_CONF="$CONF" sinfo -h >/dev/null 2>&1; then
    echo "cluster.sh: already up ($NODE); logs in $SLURM_DIR/log"
    echo "export SLURM_CONF=$CONF"
    return
  fi
  mkdir -p "$SLURM_DIR"/{state,spool,log,munge}
  cat >"$CONF" <<EOF
ClusterName=hetjax
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=30
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$SLURM_DIR/state
SlurmdSpoolDir=$SLURM_DIR/spool
SlurmctldPidFile=$SLURM_DIR/slurmctld.pid
SlurmdPidFile=$SLURM_DIR/slurmd.pid
SlurmctldLogFile=$SLURM_DIR/log/slurmctld.log
SlurmdLogFile=$SLURM_DIR/log/slurmd.log
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=$NODE CPUs=$CPUS State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
  # munge: the key the package made (or a fresh one), its daemon on its own socket dir.
  [[ -s /etc/munge/munge.key ]] || (umask 077; dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null)
  chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge 2>/dev/null || true
  mkdir -p /run/munge && chown munge:munge /run/munge
  if ! munge -n >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged || fail "munged did not start (see /var/log/munge/munged.log)"
  fi
  export SLURM_CONF="$CONF"
  /usr/sbin/slurmctld -f "$CONF"
  /usr/sbin/slurmd -f "$CONF"
  local waited=0
  until sinfo -h -N -o '%t' 2>/dev/null | grep -Eq '^(idle|mix|alloc)'; do
    (( waited++ < SLURM_WAIT_S )) || fail "node $NODE is not idle after ${SLURM_WAIT_S}s: $(sinfo -h -N 2>&1 | head -1); logs in $SLURM_DIR/log"
    sleep 1
  done
  echo "cluster.sh: one-node cluster up ($NODE, $CPUS CPUs, partition local); logs in $SLURM_DIR/log"
  echo "export SLURM_CONF=$CONF"
}

down() {
  for daemon in slurmd slurmctld; do
    local pidfile="$SLURM_DIR/$daemon.pid" pid=""
    [[ -s "$pidfile" ]] && pid="$(cat "$pidfile")"
    if [[ -n "$pid" ]] && kill "$pid" 2>/dev/null; then
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -f "$pidfile"
  done
  echo "cluster.sh: stopped (munged left running; $SLURM_DIR kept)"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) fail "usage: cluster.sh up|down" ;;
esac
