#!/usr/bin/env bash
# A two-node Slurm 22.05 cluster on the two network-namespace hosts of scripts/netns-cluster.sh: one slurmd per
# namespace (nodes nsa = host 0, 10.213.7.1, and nsb = host 1, 10.213.7.2), a slurmctld of its own in host 0.
#
#   bash scripts/netns-cluster.sh up NAME          # the hosts first
#   bash scripts/slurm-netns.sh up NAME DIR        # slurm.conf, state, spool and logs under DIR
#   SLURM_CONF=DIR/slurm.conf nsenter --net=/var/run/netns/NAME-h0 sbatch ...   # submit from host 0
#   bash scripts/slurm-netns.sh down NAME DIR      # stop the daemons (then netns-cluster.sh down NAME)
#
# Independent of the machine's own Slurm (scripts/slurm-up.sh): its own ports (7917, 7918), configuration and
# state, the machine's munged (a file socket, reachable from every network namespace). Three things make it work:
# - the daemons enter only the hosts' network namespace (`nsenter --net`), not `ip netns exec`, which mounts a
#   fresh /sys without the cgroup hierarchy slurmd needs ("No filesystem mounted on /sys/fs/cgroup");
# - `slurmd -N nsa|nsb` gives each its node name, `NodeAddr` the host's address;
# - each slurmd runs in a mount namespace of its own where /etc/hosts also names nsa and nsb (a cluster's DNS):
#   the job's ranks find rank 0's node by its name (without it: "cannot reach rank 0's host at nsa:…:
#   Temporary failure in name resolution"). The machine's /etc/hosts is not changed.
# Needs root, slurmctld/slurmd 22.05 and a running munged. Prints one status line on stdout.
set -euo pipefail

ACTION="${1:-}"
NAME="${2:-ptc}"
DIR="${3:-}"
WAIT_SECONDS="${SLURM_NETNS_WAIT:-30}"

die() { echo "slurm-netns: $*" >&2; exit 1; }
[[ -n $DIR ]] || die "usage: $0 up|down NAME DIR"
[[ $(id -u) == 0 ]] || die "needs root"
DIR="$(mkdir -p "$DIR" && cd "$DIR" && pwd)"
netns() { echo "/var/run/netns/$NAME-h$1"; }

stop() {
    local pidfile
    for pidfile in "$DIR"/slurmd-nsa.pid "$DIR"/slurmd-nsb.pid "$DIR"/slurmctld.pid; do
        [[ -s $pidfile ]] && kill "$(cat "$pidfile")" 2>/dev/null || true
        rm -f "$pidfile"
    done
}

case "$ACTION" in
    up)
        for side in 0 1; do [[ -e $(netns $side) ]] || die "host $NAME-h$side missing: run netns-cluster.sh up $NAME"; done
        command -v slurmctld >/dev/null && command -v slurmd >/dev/null || die "slurmctld/slurmd not installed"
        [[ -S /run/munge/munge.socket.2 ]] || die "munged is not running (scripts/slurm-up.sh starts it)"
        mkdir -p "$DIR"/state "$DIR"/log "$DIR"/spool-nsa "$DIR"/spool-nsb
        cat >"$DIR/slurm.conf" <<EOF
# Written by pipetrain scripts/slurm-netns.sh: two nodes in network namespaces, for tests.
ClusterName=ptns
SlurmctldHost=$(hostname -s)(10.213.7.1)
SlurmctldPort=7917
SlurmdPort=7918
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
# Timers shortened for tests (Slurm's defaults in brackets), so that a lost node requeues its job within seconds:
# a node whose slurmd stops answering is set DOWN after SlurmdTimeout (pinged every third of it) [300 s]; a requeued
# batch job is held cred_expire + 1 s while the old job's credential is revoked (5 s is Slurm's minimum) [120 s];
# the scheduler's passes start it once the hold ends [60 s and 30 s]; KillWait: SIGTERM to SIGKILL [30 s].
SlurmdTimeout=10
AuthInfo=cred_expire=10
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
KillWait=5
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
NodeName=nsa NodeAddr=10.213.7.1 CPUs=$(nproc) RealMemory=2000 State=UNKNOWN
NodeName=nsb NodeAddr=10.213.7.2 CPUs=$(nproc) RealMemory=2000 State=UNKNOWN
PartitionName=ns Nodes=nsa,nsb Default=YES MaxTime=30 State=UP
EOF
        { cat /etc/hosts; echo "10.213.7.1 nsa"; echo "10.213.7.2 nsb"; } >"$DIR/hosts"
        nsenter --net="$(netns 0)" slurmctld -f "$DIR/slurm.conf" -i
        for side in 0 1; do
            node=$([[ $side == 0 ]] && echo nsa || echo nsb)
            nsenter --net="$(netns $side)" unshare -m sh -c \
                "mount --bind '$DIR/hosts' /etc/hosts && exec slurmd -f '$DIR/slurm.conf' -N $node"
        done
        for _ in $(seq 1 "$WAIT_SECONDS"); do
            state="$(SLURM_CONF="$DIR/slurm.conf" nsenter --net="$(netns 0)" sinfo --noheader --format=%D:%t 2>/dev/null || true)"
            if [[ $state == 2:idle ]]; then
                echo "slurm-netns: up, nodes nsa (10.213.7.1) and nsb (10.213.7.2) idle; SLURM_CONF=$DIR/slurm.conf"
                exit 0
            fi
            sleep 1
        done
        stop
        die "the two nodes did not become idle within $WAIT_SECONDS s (sinfo: ${state:-no answer}); see $DIR/log"
        ;;
    down)
        stop
        echo "slurm-netns: down"
        ;;
    *)
        die "usage: $0 up|down NAME DIR"
        ;;
esac
