#!/usr/bin/env bash
# Start a single-node Slurm cluster on localhost for the tests under tests/slurm/.
#
# Idempotent and bounded in time: when `sinfo` already shows an idle node, it does nothing.
# Otherwise it installs Debian's slurmctld, slurmd, slurm-client and munge if missing, writes a
# minimal /etc/slurm/slurm.conf for this one machine, starts munged, slurmctld and slurmd as plain
# daemons (no systemd here) and waits until the node is idle. Needs root; reads no stdin.
# Prints one status line on stdout; details go to stderr and /var/log/slurm/.
set -euo pipefail

WAIT_SECONDS="${SLURM_UP_WAIT:-60}"
APT_TIMEOUT="${SLURM_UP_APT_TIMEOUT:-900}"
NODE="$(hostname -s)"
CONF_DIR=/etc/slurm
LOG_DIR=/var/log/slurm
HEADER="# Written by pipetrain scripts/slurm-up.sh"
START=$SECONDS

say() { echo "slurm-up: $*" >&2; }
status() { echo "slurm-up: $* ($((SECONDS - START)) s)"; }
fail() {
    status "FAILED: $*"
    for log in "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log"; do
        [[ -f $log ]] && { echo "--- tail $log" >&2; tail -n 15 "$log" >&2; }
    done
    exit 1
}

# True when slurmctld answers; `scontrol ping` replies at once when it is down, where sinfo retries ~9 s.
controller_up() {
    command -v scontrol >/dev/null 2>&1 && [[ "$(timeout 5 scontrol ping 2>/dev/null || true)" == *UP* ]]
}

# State of this host's node as sinfo sees it ("idle", "mix", "down*", ...), empty if no answer.
node_state() {
    controller_up || return 0
    timeout 10 sinfo --noheader --nodes="$NODE" --format='%t' 2>/dev/null | head -n 1 || true
}

# The slurm.conf this script writes for this machine.
# Hardware as slurmd sees it; 90% of the memory is offered, and SlurmdParameters=config_overrides
# keeps the node usable should the hardware report differ from this file.
render_conf() {
    local hw cpus topology mem
    hw="$(slurmd -C 2>/dev/null | head -n 1 || true)"
    cpus="$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$hw")"
    topology="$(grep -o 'Boards=[0-9]* SocketsPerBoard=[0-9]* CoresPerSocket=[0-9]* ThreadsPerCore=[0-9]*' <<<"$hw" || true)"
    mem="$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")"
    cpus="${cpus:-$(nproc)}"
    mem="${mem:-$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024))}"
    mem=$((mem * 9 / 10))
    cat <<EOF
$HEADER: one node on localhost, for tests.
ClusterName=pipetrain
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued batch job waits cred_expire + 1 s before it may start again (the old job's credential must be
# revoked first; starting it sooner fails it with "Job credential revoked"). Slurm's default is 120 s, its
# minimum 5 s; the same value bounds how long a step may take to launch. 15 s: the requeue test's hold is 16 s
# (it was 31 s at 30, the value Slurm's own test suite uses), still ample for a step launched on a loaded machine
# (the two-node cluster of scripts/slurm-netns.sh runs at 10 s).
AuthInfo=cred_expire=15
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# A requeued job whose hold has ended waits for a periodic pass of a scheduler (nothing else wakes them then): the
# main one's every 60 s and the backfill one's (30 s, skipped while nothing changed) by default, 14-22 s seen after
# the hold. Passes every 5 s start it sooner without shortening the hold.
SchedulerParameters=sched_interval=5,bf_interval=5
ReturnToService=2
SlurmdParameters=config_overrides
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
MinJobAge=300
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus${topology:+ $topology} RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
}

# Any usable node will do: on a machine that already belongs to a cluster, leave it alone. A cluster this
# script started under an older slurm.conf is reconfigured below.
ours_and_outdated() {
    head -n 1 "$CONF_DIR/slurm.conf" 2>/dev/null | grep -qF "$HEADER" && command -v slurmd >/dev/null 2>&1 &&
        [[ "$(cat "$CONF_DIR/slurm.conf")" != "$(render_conf)" ]]
}
if controller_up && ! ours_and_outdated; then
    ready="$(timeout 10 sinfo --noheader --states=idle,mixed,allocated --format='%n %t' 2>/dev/null | head -n 1 || true)"
    if [[ -n $ready ]]; then
        status "already up: node ${ready% *} is ${ready#* }"
        exit 0
    fi
fi

[[ $(id -u) -eq 0 ]] || fail "must run as root to install and start the Slurm daemons"
if [[ -f $CONF_DIR/slurm.conf ]] && ! head -n 1 "$CONF_DIR/slurm.conf" | grep -qF "$HEADER"; then
    fail "$CONF_DIR/slurm.conf was not written by this script; not touching a real cluster's configuration"
fi

# 1. Packages -------------------------------------------------------------------------------
missing=()
for pair in slurmctld:slurmctld slurmd:slurmd sinfo:slurm-client munged:munge; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
done
if ((${#missing[@]})); then
    say "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    timeout "$APT_TIMEOUT" apt-get update -qq </dev/null >&2 || fail "apt-get update failed"
    timeout "$APT_TIMEOUT" apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge </dev/null >&2 || fail "apt-get install failed"
fi

# 2. Munge ------------------------------------------------------------------------------------
if [[ ! -s /etc/munge/munge.key ]]; then
    say "creating /etc/munge/munge.key"
    mkdir -p /etc/munge
    if command -v mungekey >/dev/null 2>&1; then
        mungekey --create --keyfile=/etc/munge/munge.key --force
    else
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    fi
fi
mkdir -p /run/munge /var/lib/munge /var/log/munge
chown munge:munge /etc/munge/munge.key /run/munge /var/lib/munge /var/log/munge
chmod 0400 /etc/munge/munge.key
chmod 0755 /run/munge
munge_works() {
    for _ in $(seq 1 20); do
        munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
        sleep 0.25
    done
    return 1
}
munged_pid="$(cat /run/munge/munged.pid 2>/dev/null || true)"
if ! [[ $munged_pid =~ ^[0-9]+$ ]] || [[ "$(cat "/proc/$munged_pid/comm" 2>/dev/null)" != munged ]]; then
    say "starting munged"
    # --force: a daemon killed without cleanup (as at the end of a session) leaves its socket and pid file
    runuser -u munge -- /usr/sbin/munged --force || fail "munged did not start"
fi
if ! munge_works; then  # a dying or wedged munged: replace it
    say "munge does not answer; restarting munged"
    [[ $munged_pid =~ ^[0-9]+$ ]] && kill -9 "$munged_pid" 2>/dev/null || true
    rm -f /run/munge/munged.pid /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
    runuser -u munge -- /usr/sbin/munged --force || fail "munged did not start"
    munge_works || fail "munge credentials do not round-trip"
fi

# 3. slurm.conf ---------------------------------------------------------------------------------
mkdir -p "$CONF_DIR" "$LOG_DIR" /var/spool/slurmctld /var/spool/slurmd
new_conf="$(render_conf)"
conf_changed=0
if [[ ! -f $CONF_DIR/slurm.conf ]] || [[ "$(cat "$CONF_DIR/slurm.conf")" != "$new_conf" ]]; then
    say "writing $CONF_DIR/slurm.conf"
    printf '%s\n' "$new_conf" >"$CONF_DIR/slurm.conf"
    conf_changed=1
fi

# 4. Daemons ------------------------------------------------------------------------------------
# A daemon counts as running when its pid file names a live process with the daemon's name.
daemon_pid() {
    local pid
    pid="$(cat "$2" 2>/dev/null || true)"
    [[ $pid =~ ^[0-9]+$ ]] && [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$1" ]] && echo "$pid"
    return 0
}
stop_daemon() {
    local pid
    pid="$(daemon_pid "$1" "$2")"
    [[ -n $pid ]] || return 0
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.25; done
    kill -9 "$pid" 2>/dev/null || true
}
if ((conf_changed)); then
    stop_daemon slurmd /run/slurmd.pid
    stop_daemon slurmctld /run/slurmctld.pid
fi
if [[ -z "$(daemon_pid slurmctld /run/slurmctld.pid)" ]]; then
    say "starting slurmctld"
    slurmctld </dev/null || fail "slurmctld did not start"
fi
# slurmd registers faster when the controller already answers.
for _ in $(seq 1 60); do
    controller_up && break
    sleep 0.25
done
if [[ -z "$(daemon_pid slurmd /run/slurmd.pid)" ]]; then
    say "starting slurmd"
    slurmd </dev/null || fail "slurmd did not start"
fi

# 5. Wait until the node is idle, resuming it once if it comes up down or drained -----------------
resumed=0
deadline=$((SECONDS + WAIT_SECONDS))
while ((SECONDS < deadline)); do
    state="$(node_state)"
    case "$state" in
        idle | mix | mixed | alloc | allocated | comp | completing)
            status "up: node $NODE is $state, partition debug"
            exit 0
            ;;
        down* | drain* | drng* | fail*)
            if ((!resumed)); then
                say "node is $state, resuming it"
                scontrol update nodename="$NODE" state=resume >&2 || true
                resumed=1
            fi
            ;;
    esac
    [[ -n "$(daemon_pid slurmctld /run/slurmctld.pid)" ]] || fail "slurmctld exited"
    [[ -n "$(daemon_pid slurmd /run/slurmd.pid)" ]] || fail "slurmd exited"
    sleep 1
done
fail "node $NODE not idle after ${WAIT_SECONDS} s (state: '$(node_state)')"
