#!/usr/bin/env bash
# scripts/slurm.sh - install, configure and start a single-node Slurm
# cluster (munged + slurmctld + slurmd run directly as daemons, no systemd).
#
# Run as root on Debian/Ubuntu.  Idempotent: if the daemons already run and
# `srun -n 1 true` works, it exits 0 right away.
#
# Environment overrides (optional):
#   SLURM_WAIT_TIMEOUT  seconds to wait for the node to become idle (default 60)
#   SLURM_PARTITION     partition name (default "debug")
#   SLURM_CLUSTER       cluster name (default "single")
#   SLURM_FORCE_RECONF  =1: reconfigure/restart even if everything already works
#   SLURM_FIX_HOSTS     =1: add "127.0.0.1 $(hostname -s)" to /etc/hosts if the
#                       short hostname does not resolve (Slurm itself does not need it)
set -euo pipefail

WAIT_TIMEOUT="${SLURM_WAIT_TIMEOUT:-60}"
PARTITION="${SLURM_PARTITION:-debug}"
CLUSTER="${SLURM_CLUSTER:-single}"

CONF_DIR=/etc/slurm
CONF="$CONF_DIR/slurm.conf"
LOG_DIR=/var/log/slurm
RUN_DIR=/run/slurm
CTLD_STATE=/var/spool/slurmctld
SLURMD_SPOOL=/var/spool/slurmd
CTLD_LOG="$LOG_DIR/slurmctld.log"
SLURMD_LOG="$LOG_DIR/slurmd.log"
CTLD_PID="$RUN_DIR/slurmctld.pid"
SLURMD_PID="$RUN_DIR/slurmd.pid"
MUNGE_KEY=/etc/munge/munge.key
MUNGE_LOG=/var/log/munge/munged.log

log() { echo "[slurm] $*"; }
die() { echo "[slurm] ERROR: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must be run as root"

NODE="$(hostname -s 2>/dev/null || uname -n)"
NODE="${NODE%%.*}"
[ -n "$NODE" ] || die "cannot determine short hostname"

show_logs() {
    local f
    for f in "$MUNGE_LOG" "$CTLD_LOG" "$SLURMD_LOG"; do
        echo "===== last 40 lines of $f =====" >&2
        if [ -r "$f" ]; then tail -n 40 "$f" >&2; else echo "(missing)" >&2; fi
    done
    echo "===== processes =====" >&2
    ps -eo pid,user,args | grep -E '[m]unged|[s]lurmctld|[s]lurmd' >&2 || echo "(none running)" >&2
    if command -v sinfo >/dev/null 2>&1; then
        echo "===== sinfo =====" >&2
        timeout 10 sinfo -N -l >&2 2>&1 || true
        timeout 10 scontrol show node "$NODE" >&2 2>&1 || true
    fi
}

fail() { echo "[slurm] ERROR: $*" >&2; show_logs; exit 1; }

# PIDs of live (non-zombie) processes with this exact name.  Zombies are
# ignored: in containers a daemon's reparented corpse can linger a while.
pids_of() { ps -C "$1" -o pid=,stat= 2>/dev/null | awk '$2 !~ /^Z/ {print $1}'; }
running() { [ -n "$(pids_of "$1")" ]; }

munge_ok() { command -v munge >/dev/null 2>&1 && munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

node_state() { timeout 5 sinfo -h -N -n "$NODE" -o '%T' 2>/dev/null | head -n1 || true; }
# slurmctld restores the last node state from its state files, so "idle" alone
# does not prove the (re)started slurmd has registered; SlurmdStartTime does.
node_registered() {
    local t
    t="$(timeout 5 scontrol -o show node "$NODE" 2>/dev/null | tr ' ' '\n' | sed -n 's/^SlurmdStartTime=//p')"
    [ -n "$t" ] && [ "$t" != None ]
}

# ---------------------------------------------------------------- fast path
# Already up?  Daemons running, controller answering, node known and healthy,
# and srun works.  If the node is fully allocated (another user's jobs), a
# test srun would just queue, so a healthy busy node counts as working too -
# we must never restart daemons under running jobs.
already_ok() {
    running munged && running slurmctld && running slurmd || return 1
    command -v srun >/dev/null 2>&1 || return 1
    timeout 5 scontrol ping 2>/dev/null | grep -q UP || return 1
    node_registered || return 1
    case "$(node_state)" in
        allocated|completing) return 0 ;;
        idle|mixed) timeout 30 srun --immediate=15 -n 1 true >/dev/null 2>&1 ;;
        *) return 1 ;;
    esac
}
if [ "${SLURM_FORCE_RECONF:-0}" != 1 ] && already_ok; then
    log "Slurm already running on node '$NODE' (state: $(node_state)) and working - nothing to do."
    exit 0
fi

# ---------------------------------------------------------------- packages
PKGS="munge slurmctld slurmd slurm-client"
need_install=0
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need_install=1
done
if [ "$need_install" = 1 ]; then
    log "installing packages: $PKGS"
    # Keep maintainer scripts from trying to start services (no systemd/init here);
    # we start the daemons ourselves below.
    created_policy=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        created_policy=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    rc=0
    { apt-get update && apt-get install -y --no-install-recommends $PKGS; } || rc=$?
    [ "$created_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
    [ "$rc" -eq 0 ] || die "apt-get failed (rc=$rc)"
else
    log "packages already installed: $PKGS"
fi
for c in munged munge unmunge slurmctld slurmd srun sinfo scontrol; do
    command -v "$c" >/dev/null 2>&1 || die "command '$c' not found after installation"
done
SLURM_VERSION="$(dpkg-query -W -f='${Version}' slurmd 2>/dev/null || true)"
log "installed: slurmd $SLURM_VERSION"

# ---------------------------------------------------------------- hostname
# Slurm does not need the node name to resolve: slurm.conf pins every address
# to 127.0.0.1 (SlurmctldHost=NAME(127.0.0.1), NodeAddr=127.0.0.1).  Other
# tools may need it, so optionally (SLURM_FIX_HOSTS=1) add it to /etc/hosts.
if ! getent hosts "$NODE" >/dev/null 2>&1; then
    if [ "${SLURM_FIX_HOSTS:-0}" = 1 ]; then
        log "hostname '$NODE' does not resolve - adding '127.0.0.1 $NODE' to /etc/hosts"
        echo "127.0.0.1 $NODE" >> /etc/hosts
    else
        log "note: hostname '$NODE' does not resolve; fine for Slurm (addresses pinned to 127.0.0.1)," \
            "set SLURM_FIX_HOSTS=1 to add it to /etc/hosts"
    fi
fi

# ---------------------------------------------------------------- munge
MUNGE_USER=munge
id "$MUNGE_USER" >/dev/null 2>&1 || MUNGE_USER=root
mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge
key_created=0
if [ ! -s "$MUNGE_KEY" ]; then
    log "creating munge key $MUNGE_KEY"
    if command -v mungekey >/dev/null 2>&1; then
        rm -f "$MUNGE_KEY"
        mungekey --create --keyfile="$MUNGE_KEY" || dd if=/dev/urandom of="$MUNGE_KEY" bs=1 count=1024 status=none
    else
        dd if=/dev/urandom of="$MUNGE_KEY" bs=1 count=1024 status=none
    fi
    key_created=1
fi
chown "$MUNGE_USER:$MUNGE_USER" /etc/munge "$MUNGE_KEY" /var/lib/munge /var/log/munge /run/munge
chmod 0700 /etc/munge /var/lib/munge /var/log/munge
chmod 0400 "$MUNGE_KEY"
chmod 0755 /run/munge

if running munged && { [ "$key_created" = 1 ] || ! munge_ok; }; then
    log "munged running but not usable (or key changed) - restarting it"
    for pid in $(pids_of munged); do kill "$pid" 2>/dev/null || true; done
    for _ in $(seq 1 20); do running munged || break; sleep 0.5; done
fi
if ! running munged; then
    log "starting munged (as user $MUNGE_USER)"
    # --force: overrides a stale socket left behind by a previous instance
    if [ "$MUNGE_USER" = root ]; then
        munged --force || fail "munged failed to start"
    else
        runuser -u "$MUNGE_USER" -- munged --force || fail "munged failed to start"
    fi
fi
for _ in $(seq 1 20); do munge_ok && break; sleep 0.5; done
munge_ok || fail "munge credential round trip (munge -n | unmunge) fails"
log "munge OK"

# ---------------------------------------------------------------- stop old slurm daemons
# We only get here if something is not working: restart Slurm cleanly.
stop_daemon() {
    local name="$1" pid
    running "$name" || return 0
    log "stopping running $name"
    for pid in $(pids_of "$name"); do kill "$pid" 2>/dev/null || true; done
    for _ in $(seq 1 30); do running "$name" || return 0; sleep 0.5; done
    for pid in $(pids_of "$name"); do kill -9 "$pid" 2>/dev/null || true; done
    sleep 1
}
stop_daemon slurmd
stop_daemon slurmctld

# ---------------------------------------------------------------- config
mkdir -p "$CONF_DIR" "$LOG_DIR" "$RUN_DIR" "$CTLD_STATE" "$SLURMD_SPOOL"
chmod 0755 "$CONF_DIR" "$LOG_DIR" "$RUN_DIR" "$CTLD_STATE" "$SLURMD_SPOOL"

CPUS="$(nproc)"
# RealMemory: 90% of what slurmd detects (fallback: /proc/meminfo), min 100 MB
MEM="$(slurmd -C 2>/dev/null | tr ' ' '\n' | sed -n 's/^RealMemory=//p' | head -n1 || true)"
if ! [[ "$MEM" =~ ^[0-9]+$ ]] || [ "$MEM" -le 0 ]; then
    MEM="$(awk '/^MemTotal:/ {print int($2/1024)}' /proc/meminfo)"
fi
MEM=$(( MEM * 9 / 10 ))
[ "$MEM" -ge 100 ] || MEM=100

NEW_CONF="$(mktemp)"
cat > "$NEW_CONF" <<CONF
# Generated by zeropp scripts/slurm.sh - single-node Slurm cluster
ClusterName=$CLUSTER
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$CTLD_STATE
SlurmdSpoolDir=$SLURMD_SPOOL
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$CTLD_LOG
SlurmdLogFile=$SLURMD_LOG
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups in containers
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# trust the node line below rather than detected hardware
SlurmdParameters=config_overrides
ReturnToService=2
# reject (instead of queueing forever) jobs that can never fit, e.g. srun -n 3 without -O on 2 CPUs
EnforcePartLimits=ALL
# no accounting
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
InactiveLimit=0
KillWait=30
MinJobAge=300
SlurmctldTimeout=120
SlurmdTimeout=300
Waittime=0
# node + partition
NodeName=$NODE NodeAddr=127.0.0.1 NodeHostname=$NODE CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
CONF
if [ -f "$CONF" ] && ! cmp -s "$NEW_CONF" "$CONF"; then
    cp -p "$CONF" "$CONF.bak.$(date +%Y%m%d%H%M%S)"
    log "existing $CONF differs - backed up"
fi
install -m 0644 "$NEW_CONF" "$CONF"
rm -f "$NEW_CONF"
log "wrote $CONF (NodeName=$NODE CPUs=$CPUS RealMemory=$MEM)"

# ---------------------------------------------------------------- start slurm
log "starting slurmctld"
rm -f "$CTLD_PID"
slurmctld -f "$CONF" || fail "slurmctld failed to start"
for _ in $(seq 1 30); do timeout 5 scontrol ping 2>/dev/null | grep -q UP && break; sleep 1; done
timeout 5 scontrol ping 2>/dev/null | grep -q UP || fail "slurmctld does not answer (scontrol ping)"

log "starting slurmd"
rm -f "$SLURMD_PID"
slurmd -f "$CONF" -N "$NODE" || fail "slurmd failed to start"

# ---------------------------------------------------------------- wait for idle
log "waiting up to ${WAIT_TIMEOUT}s for node '$NODE' to become idle"
deadline=$(( $(date +%s) + WAIT_TIMEOUT ))
resumed=0
state=""
while :; do
    state="$(node_state)"
    case "$state" in
        idle|mixed|allocated) node_registered && break ;;
        down*|drain*|fail*)
            # e.g. left down/drained from an earlier run
            if [ "$resumed" = 0 ]; then
                log "node state '$state' - trying to resume it"
                timeout 5 scontrol update nodename="$NODE" state=resume 2>/dev/null || true
                resumed=1
            fi ;;
    esac
    running slurmctld || fail "slurmctld died"
    running slurmd || fail "slurmd died"
    [ "$(date +%s)" -lt "$deadline" ] || fail "node '$NODE' not idle with slurmd registered after ${WAIT_TIMEOUT}s (state: '${state:-unknown}', slurmd registered: $(node_registered && echo yes || echo no))"
    sleep 1
done
log "node '$NODE' is $state"

timeout 60 srun --immediate=30 -n 1 true || fail "'srun -n 1 true' failed"
log "srun works - single-node Slurm cluster is up ($(sinfo --version 2>/dev/null))"
for _ in $(seq 1 10); do [ "$(node_state)" = idle ] && break; sleep 0.5; done  # let the test job finish completing
timeout 10 sinfo || true
