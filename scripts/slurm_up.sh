#!/usr/bin/env bash
# A one-node Slurm on this machine for the `slurm` tests (tests/integration/test_slurm.py,
# docs/cluster.md): Debian's slurm-wlm and munge, run as root. Every address is loopback: nothing of it
# listens for or talks to another machine. Safe to run again: what already runs is left running.
#
#   bash scripts/slurm_up.sh         # install what is missing, start, wait until the node is idle and runs a job
#   bash scripts/slurm_up.sh stop    # stop the daemons this script started
#
# State, spool, logs and pid files live in $FP8CONVERT_SLURM_DIR (default /var/tmp/fp8convert-slurm);
# the configuration is /etc/slurm/slurm.conf, where every Slurm command looks for it. A slurm.conf this
# script did not write is never replaced.
set -euo pipefail

DIR=${FP8CONVERT_SLURM_DIR:-/var/tmp/fp8convert-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# written by fp8convert scripts/slurm_up.sh"
MUNGE_SOCKET=/run/munge/munge.socket.2
WAIT_S=${FP8CONVERT_SLURM_WAIT_S:-60}

fail() {
    echo "slurm_up.sh: $*" >&2
    for log in "$DIR"/log/*.log "$DIR"/munge/munged.log; do
        # (without the lines of the MPI plugins Debian ships but this setup does not use)
        [ -f "$log" ] && { echo "--- tail of $log" >&2; grep -v -e pmix -e "MPI: Cannot" "$log" | tail -n 15 >&2; }
    done
    exit 1
}

running() {  # running PIDFILE: the process it names is alive
    [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

stop() {
    local name pidfile
    for name in slurmd slurmctld munge/munged; do
        pidfile="$DIR/$name.pid"
        if running "$pidfile"; then
            kill "$(cat "$pidfile")"
            for _ in $(seq 50); do running "$pidfile" || break; sleep 0.2; done
            running "$pidfile" && fail "${name#*/} (pid $(cat "$pidfile")) did not stop"
            echo "stopped ${name#*/}"
        fi
        rm -f "$pidfile"
    done
}

install_packages() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return
    command -v apt-get >/dev/null || fail "slurm-wlm and munge are missing and there is no apt-get to install them"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge
}

start_munge() {
    if [ ! -s /etc/munge/munge.key ]; then
        mkdir -p /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    chown munge:munge /etc/munge /etc/munge/munge.key
    chmod 700 /etc/munge
    chmod 400 /etc/munge/munge.key
    # A munged already answering (the system's, or ours from an earlier run) is used as it is.
    munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return
    mkdir -p /run/munge "$DIR/munge"
    chown munge:munge /run/munge "$DIR/munge"
    chmod 755 /run/munge
    chmod 700 "$DIR/munge"
    runuser -u munge -- munged --socket="$MUNGE_SOCKET" --pid-file="$DIR/munge/munged.pid" \
        --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed" ||
        fail "munged did not start"
    munge -n </dev/null | unmunge >/dev/null || fail "munged runs but its credentials do not decode"
}

write_conf() {
    local node
    # slurmd -C: this host as slurmd sees it (name, CPUs, sockets, cores, threads, memory), so the node
    # is never drained for having less than it claims.
    node=$(slurmd -C | head -n 1)
    [[ $node == "NodeName=$(hostname -s) "* ]] || fail "slurmd -C printed '$node', not NodeName=$(hostname -s)"
    if [ -e "$CONF" ] && ! grep -qxF "$MARK" "$CONF"; then
        fail "$CONF exists and was not written by this script; not replacing it"
    fi
    mkdir -p /etc/slurm "$DIR/state" "$DIR/spool" "$DIR/log"
    cat > "$CONF.tmp" <<EOF
$MARK
ClusterName=fp8convert
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# Daemons and clients bind to the address the host name resolves to (loopback here), not to every address.
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$CONF.tmp" "$CONF"
}

node_state() {
    sinfo -h -N -n "$(hostname -s)" -o %T 2>/dev/null | head -n 1
}

up() {
    [ "$(id -u)" = 0 ] || fail "run it as root (it installs packages and starts system daemons)"
    install_packages
    start_munge
    write_conf
    if ! running "$DIR/slurmctld.pid"; then
        slurmctld || fail "slurmctld did not start"
    fi
    if ! running "$DIR/slurmd.pid"; then
        slurmd || fail "slurmd did not start"
    fi
    local state=""
    for _ in $(seq $((WAIT_S * 2))); do
        state=$(node_state)
        case $state in idle | mixed | allocated) break ;; esac
        sleep 0.5
    done
    case $state in
        idle | mixed | allocated) ;;
        *) fail "node $(hostname -s) is not idle after ${WAIT_S}s (sinfo says '${state:-nothing}')" ;;
    esac
    # slurmctld restores the node's state from its last run, so "idle" can be said before this slurmd has
    # registered, or of one that died: a job that runs is the proof.
    timeout "$WAIT_S" srun --nodes=1 --ntasks=1 --time=1 true ||
        fail "node $(hostname -s) is $state, but a one-task job (srun true) did not run within ${WAIT_S}s"
    echo "Slurm is up: node $(hostname -s) $state ($(sinfo --version))"
}

case ${1:-up} in
    up) up ;;
    stop) stop ;;
    *) echo "usage: $0 [stop]" >&2; exit 2 ;;
esac
