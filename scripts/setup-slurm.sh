#!/usr/bin/env bash
# setup-slurm.sh - a multi-node Slurm cluster on this one machine, from Debian's
# packages (slurmctld, slurmd, slurm-client, munge), for the `--launcher slurm`
# tests. Runs as root; idempotent.
#
#   scripts/setup-slurm.sh [start]      install what is missing, build the node
#                                       namespaces, configure, start munged,
#                                       slurmctld and one slurmd per node, wait
#                                       until every node is idle and a step runs,
#                                       then print the `export` lines below
#   scripts/setup-slurm.sh env          print the `export` lines only
#   scripts/setup-slurm.sh status       daemons, `sinfo -N` and `squeue`
#   scripts/setup-slurm.sh stop         cancel every job, stop the daemons, remove
#                                       the namespaces, bridges and /etc/hosts lines
#   scripts/setup-slurm.sh reset        stop, then wipe the cluster's state
#   scripts/setup-slurm.sh node-stop N  SIGTERM node N's slurmd only (its running
#                                       steps stay, as when the daemon dies)
#   scripts/setup-slurm.sh node-kill N  SIGKILL every process on node N (a crash)
#   scripts/setup-slurm.sh node-start N start node N's slurmd again; wait until idle
#
# Progress goes to stderr and stdout carries only `export NAME=VALUE` lines:
#     eval "$(scripts/setup-slurm.sh)"
# exports SLURM_CONF (the config, at Slurm's default path) and
# PSLAUNCH_SLURM_TESTBED (a JSON description of the nodes, for the tests).
#
# Settings (environment): PSLAUNCH_SLURM_NODES (4, at most 8),
# PSLAUNCH_SLURM_CPUS (4 CPUs declared per node, overcommitted on purpose),
# PSLAUNCH_SLURM_PARTITION (debug), PSLAUNCH_SLURM_PROCTRACK (linuxproc or pgid),
# PSLAUNCH_SLURM_SLURMD_TIMEOUT (10 s: a node that does not answer for that long
# is DOWN and its jobs fail, ~15 s after its slurmd stopped), PSLAUNCH_SLURM_WAIT
# (60 s per wait), PSLAUNCH_SLURM_SMOKE_TEST (1: `srun -N<all> hostname` at the end).
#
# Layout (see docs/slurm.md, "The test cluster"):
#   root namespace (the launching host and submit host)
#     psslurm-a  bridge 10.202.1.1/24   slurmctld (port 6817), the nodes' Slurm network
#     psslurm-b  bridge 10.202.2.1/24   a second, data network
#     munged     one, its socket /run/munge/munge.socket.2 shared by every node
#   node sN (N = 0..NODES-1): network namespace psslurm-sN plus its own UTS
#   namespace (hostname sN), slurmd -N sN on port 6818 of its own addresses:
#     A side 10.202.1.(10+N) on eth0, ens1, enp2s0, eno1, ... (differs per node)
#     B side 10.202.2.(10+N) on data0, ib0, bond0, ib1, ...
#   The mount namespace is shared (a cluster file system): the nodes see the
#   launcher's files and working directory. /etc/hosts maps sN to its A address.
#
# What it solves that a plain `apt-get install slurmd slurmctld` does not:
#  1. No init system: the daemons are started here, and postinst must not try.
#  2. Several slurmd on one machine without Slurm's --enable-multiple-slurmd build:
#     each runs in its own network namespace, so all use port 6818 and their own
#     addresses; `slurmd -N NAME` picks its node, %n gives each its spool, log
#     and pid file.
#  3. No cgroup plugins (v1 cgroups are mounted here, but Slurm's cgroup paths
#     would collide between nodes on one kernel): proctrack/linuxproc, task/none.
#  4. 4 CPUs declared per node on a 2-core machine: SlurmdParameters=config_overrides
#     keeps such a node from being drained for "Low socket*core*thread count".
#  5. Short timeouts (SlurmdTimeout, MessageTimeout, KillWait) so failures show
#     in seconds, and ReturnToService=2 so a restarted node comes back idle.
set -euo pipefail

readonly CONF_DIR=/etc/slurm
readonly CONF=$CONF_DIR/slurm.conf
readonly CGROUP_CONF=$CONF_DIR/cgroup.conf
readonly STATE=/var/lib/pslaunch-slurm
readonly TESTBED_JSON=$STATE/testbed.json
readonly LOGS=/var/log/pslaunch-slurm
readonly RUN=/run/pslaunch-slurm
readonly SETUP_LOG=$LOGS/setup.log
readonly MUNGE_SOCKET=/run/munge/munge.socket.2
readonly MUNGE_PID=/run/munge/munged.pid
readonly CTLD_PID=$RUN/slurmctld.pid
readonly HOSTS_TAG="# pslaunch-slurm testbed"

readonly NET_A=10.202.1 NET_B=10.202.2          # inside tests/netguard's allowed 10.202.0.0/16
readonly BR_A=psslurm-a BR_B=psslurm-b
IFACES_A=(eth0 ens1 enp2s0 eno1 eth1 ens5 enp7s0 eno8)
IFACES_B=(data0 ib0 bond0 ib1 data1 ib5 bond7 ib8)

NODES=${PSLAUNCH_SLURM_NODES:-4}
# the verbs other than start act on the cluster as it was configured
if [ -z "${PSLAUNCH_SLURM_NODES:-}" ] && [ "${1:-start}" != start ] && [ -s "$CONF" ]; then
    NODES=$(grep -c '^NodeName=' "$CONF" || true)
    [[ $NODES =~ ^[1-8]$ ]] || NODES=4
fi
CPUS=${PSLAUNCH_SLURM_CPUS:-4}
PARTITION=${PSLAUNCH_SLURM_PARTITION:-debug}
PROCTRACK=${PSLAUNCH_SLURM_PROCTRACK:-linuxproc}
WAIT=${PSLAUNCH_SLURM_WAIT:-60}
SLURMD_TIMEOUT=${PSLAUNCH_SLURM_SLURMD_TIMEOUT:-10}
SMOKE=${PSLAUNCH_SLURM_SMOKE_TEST:-1}

PACKAGES=(munge slurm-client slurmctld slurmd)

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# apt_install (serialised with the other scripts/deps steps), log, die
# shellcheck source=deps/lib.sh
source "$HERE/deps/lib.sh"
T0=$(date +%s.%N)
note() { printf '[setup-slurm %5.1fs] %s\n' "$(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')" "$*" >&2; }
fail() { printf '[setup-slurm] ERROR: %s\n' "$*" >&2; exit 1; }

node_name() { echo "sn$1"; }
node_ns() { echo "psslurm-sn$1"; }
addr_a() { echo "$NET_A.$((10 + $1))"; }
addr_b() { echo "$NET_B.$((10 + $1))"; }
node_index() {  # node_index NAME: N for sN, if it is a node of this cluster
    [[ $1 =~ ^sn([0-9])$ ]] && [ "${BASH_REMATCH[1]}" -lt "$NODES" ] || fail "no node '$1' (nodes: sn0..sn$((NODES - 1)))"
    echo "${BASH_REMATCH[1]}"
}

# --- processes ----------------------------------------------------------------------

# alive PID NAME: PID runs (not a zombie) and is NAME.
alive() {
    local pid=$1 name=$2 state
    [[ $pid =~ ^[0-9]+$ ]] && [ -r "/proc/$pid/stat" ] || return 1
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ] || return 1
    state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
    [ "$state" != Z ] && [ "$state" != X ]
}
pid_from() {  # pid_from FILE NAME: the live NAME whose pid FILE holds
    local p
    p=$(cat "$1" 2>/dev/null) || return 1
    alive "$p" "$2" && echo "$p"
}
gone() { ! alive "$1" "$2"; }
poll() {  # poll SECONDS CMD...: run CMD every 0.2 s until it succeeds or time runs out
    local end=$(( $(date +%s) + $1 )); shift
    until "$@"; do
        [ "$(date +%s)" -lt "$end" ] || return 1
        sleep 0.2
    done
}
stop_pid() {  # stop_pid PID NAME: SIGTERM, then SIGKILL after 20 s
    local pid=$1 name=$2
    alive "$pid" "$name" || return 0
    note "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    if ! poll 20 gone "$pid" "$name"; then
        note "$name ignored SIGTERM; SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        poll 10 gone "$pid" "$name" || fail "cannot stop $name (pid $pid)"
    fi
}
log_tail() {
    local f
    for f in "$@"; do
        [ -s "$f" ] && { echo "--- $f" >&2; tail -n 15 "$f" >&2; }
    done
    return 0
}

munged_pid() { pid_from "$MUNGE_PID" munged; }
ctld_pid() { pid_from "$CTLD_PID" slurmctld; }
slurmd_pidfile() { echo "$RUN/slurmd-$(node_name "$1").pid"; }
slurmd_log() { echo "$LOGS/slurmd-$(node_name "$1").log"; }
# slurmd_pid N: node N's slurmd, if it runs in node N's network namespace
slurmd_pid() {
    local p
    p=$(pid_from "$(slurmd_pidfile "$1")" slurmd) || return 1
    [ "$(ns_inode "/proc/$p/ns/net")" = "$(ns_inode "/run/netns/$(node_ns "$1")")" ] || return 1
    echo "$p"
}
ns_inode() { stat -L -c %i "$1" 2>/dev/null; }
ns_pids() { ip netns pids "$1" 2>/dev/null || true; }

print_env() {
    echo "export SLURM_CONF=$CONF"
    echo "export PSLAUNCH_SLURM_TESTBED=$TESTBED_JSON"
}

# --- install ---------------------------------------------------------------------------

POLICY_ADDED=0
cleanup() {
    [ "$POLICY_ADDED" = 1 ] && rm -f /usr/sbin/policy-rc.d
    return 0
}

install_packages() {
    local missing=0 p
    for p in "${PACKAGES[@]}"; do
        [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" = "install ok installed" ] || missing=1
    done
    if [ $missing = 0 ]; then note "packages present ($(slurmd -V 2>/dev/null))"; return 0; fi
    # postinst must not start daemons (there is no init system; we start them below)
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        POLICY_ADDED=1
    fi
    note "installing ${PACKAGES[*]} (log: $SETUP_LOG)"
    apt_install "${PACKAGES[@]}" 2>>"$SETUP_LOG" || { tail -n 20 "$SETUP_LOG" >&2; fail "apt-get install failed"; }
    if [ "$POLICY_ADDED" = 1 ]; then rm -f /usr/sbin/policy-rc.d; POLICY_ADDED=0; fi
    note "packages installed ($(slurmd -V 2>/dev/null))"
}

# --- network ------------------------------------------------------------------------------

bridge_ok() {  # bridge_ok NAME ADDR
    ip -o -4 addr show dev "$1" 2>/dev/null | grep -q " $2/24 " \
        && ip -o link show dev "$1" 2>/dev/null | grep -q 'state UP\|,UP'
}
node_net_ok() {  # node_net_ok N: namespace, both interfaces with their names and addresses
    local ns i=$1
    ns=$(node_ns "$i")
    [ -e "/run/netns/$ns" ] || return 1
    ip -n "$ns" -o -4 addr show dev "${IFACES_A[$i]}" 2>/dev/null | grep -q " $(addr_a "$i")/24 " || return 1
    ip -n "$ns" -o -4 addr show dev "${IFACES_B[$i]}" 2>/dev/null | grep -q " $(addr_b "$i")/24 " || return 1
    ip -n "$ns" -o link show dev lo 2>/dev/null | grep -q 'UP' || return 1
    ip -o link show dev "psslurm-${i}a" 2>/dev/null | grep -q "master $BR_A" || return 1
    ip -o link show dev "psslurm-${i}b" 2>/dev/null | grep -q "master $BR_B"
}
kill_ns() {  # kill_ns NS: SIGKILL every process in a network namespace, wait until none is left
    local ns=$1 pids
    pids=$(ns_pids "$ns")
    [ -n "$pids" ] || return 0
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
    poll 10 test -z "$(ns_pids "$ns")" || note "processes left in $ns: $(ns_pids "$ns" | tr '\n' ' ')"
}
remove_node_net() {
    local i=$1 ns
    ns=$(node_ns "$i")
    if [ -e "/run/netns/$ns" ]; then
        kill_ns "$ns"
        ip netns del "$ns" 2>/dev/null || true
    fi
    ip link del "psslurm-${i}a" 2>/dev/null || true
    ip link del "psslurm-${i}b" 2>/dev/null || true
}
network() {
    local br addr i ns side iface outer tmp made=0
    for br in "$BR_A:$NET_A.1" "$BR_B:$NET_B.1"; do
        addr=${br#*:}; br=${br%%:*}
        bridge_ok "$br" "$addr" && continue
        ip link show dev "$br" >/dev/null 2>&1 || ip link add name "$br" type bridge
        ip -o -4 addr show dev "$br" | grep -q " $addr/24 " || ip addr add "$addr/24" dev "$br"
        ip link set "$br" up
        made=1
    done
    for ((i = 0; i < NODES; i++)); do
        node_net_ok "$i" && continue
        ns=$(node_ns "$i")
        remove_node_net "$i"
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        for side in a b; do
            if [ $side = a ]; then iface=${IFACES_A[$i]} addr=$(addr_a "$i") br=$BR_A
            else iface=${IFACES_B[$i]} addr=$(addr_b "$i") br=$BR_B; fi
            outer=psslurm-$i$side tmp=psslurmt-$i$side
            ip link add "$outer" type veth peer name "$tmp"
            ip link set "$tmp" netns "$ns"
            ip -n "$ns" link set "$tmp" name "$iface"
            ip link set "$outer" master "$br" up
            ip -n "$ns" addr add "$addr/24" dev "$iface"
            ip -n "$ns" link set "$iface" up
        done
        made=1
    done
    # nodes of a larger earlier cluster
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep '^psslurm-sn' || true); do
        i=${ns#psslurm-sn}
        [ "$i" -lt "$NODES" ] || { note "removing node sn$i (PSLAUNCH_SLURM_NODES=$NODES)"; remove_node_net "$i"; }
    done
    if [ $made = 1 ]; then note "network: bridges $BR_A $NET_A.1/24, $BR_B $NET_B.1/24, $NODES node namespaces"
    else note "network present"; fi
}

# /etc/hosts: sN -> its A address, so node names resolve on every node and here
hosts_file() {
    local want i cur
    want=$(for ((i = 0; i < NODES; i++)); do printf '%s\t%s\t%s\n' "$(addr_a "$i")" "$(node_name "$i")" "$HOSTS_TAG"; done)
    cur=$(grep -F "$HOSTS_TAG" /etc/hosts || true)
    [ "$cur" = "$want" ] && return 0
    remove_hosts
    printf '%s\n' "$want" >>/etc/hosts
}
remove_hosts() {
    grep -qF "$HOSTS_TAG" /etc/hosts 2>/dev/null || return 0
    # /etc/hosts may be a bind mount: rewrite it in place, never replace it
    local keep
    keep=$(grep -vF "$HOSTS_TAG" /etc/hosts || true)
    printf '%s\n' "$keep" >/etc/hosts
}

# --- munge -----------------------------------------------------------------------------------

munge_ok() { munge -n -S "$MUNGE_SOCKET" </dev/null 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1; }
start_munge() {
    local pid
    pid=$(munged_pid || true)
    if [ -n "$pid" ] && munge_ok; then note "munged runs (pid $pid)"; return 0; fi
    [ -z "$pid" ] || stop_pid "$pid" munged
    [ -s /etc/munge/munge.key ] || { note "creating /etc/munge/munge.key"; /usr/sbin/mungekey --create >&2; }
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
    note "starting munged"
    (cd / && exec runuser -u munge -- /usr/sbin/munged </dev/null >>"$SETUP_LOG" 2>&1 8>&-) \
        || { log_tail /var/log/munge/munged.log "$SETUP_LOG"; fail "munged did not start"; }
    poll "$WAIT" munge_ok || { log_tail /var/log/munge/munged.log; fail "munged does not answer on $MUNGE_SOCKET"; }
    note "munged up (pid $(munged_pid || echo '?'))"
}

# --- configuration ----------------------------------------------------------------------------

slurm_conf() {
    local i ctl
    ctl=$(hostname -s)
    cat <<EOF
# Written by scripts/setup-slurm.sh; rewritten on every start. See docs/slurm.md.
ClusterName=pslaunch
SlurmctldHost=$ctl($NET_A.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
CredType=cred/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/node/%n
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups: their paths would collide between the nodes on one kernel
ProctrackType=proctrack/$PROCTRACK
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
# backfill, Slurm's default (heterogeneous jobs need it); every second, not every 30 s
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
DefMemPerCPU=100
# declared CPUs and memory may exceed this machine's: it is a test cluster
SlurmdParameters=config_overrides
ReturnToService=2
# short timeouts: a test cluster should fail in seconds, not minutes
SlurmdTimeout=$SLURMD_TIMEOUT
SlurmctldTimeout=10
MessageTimeout=5
TCPTimeout=2
KillWait=2
UnkillableStepTimeout=20
InactiveLimit=0
MinJobAge=120
EOF
    for ((i = 0; i < NODES; i++)); do
        echo "NodeName=$(node_name "$i") NodeAddr=$(addr_a "$i") NodeHostname=$(node_name "$i") CPUs=$CPUS RealMemory=4000 State=UNKNOWN"
    done
    echo "PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
}

# slurmd 22.05 loads a cgroup plugin whatever the other plugins are; left to autodetect,
# it looks at /sys/fs/cgroup, which is empty in a node (ip netns exec mounts a fresh
# /sys), and slurmd exits. Naming cgroup/v1 skips the autodetection: its init() mounts
# nothing, and nothing else here (proctrack/linuxproc, task/none, no core or memory
# specialisation) ever asks it for a cgroup.
cgroup_conf() {
    cat <<EOF
# Written by scripts/setup-slurm.sh. No cgroups are used; see the script.
CgroupPlugin=cgroup/v1
CgroupAutomount=no
EOF
}

testbed_json() {
    local i sep=
    printf '{\n  "conf": "%s",\n  "partition": "%s",\n  "controller": {"addr_a": "%s", "addr_b": "%s", "bridge_a": "%s", "bridge_b": "%s"},\n' \
        "$CONF" "$PARTITION" "$NET_A.1" "$NET_B.1" "$BR_A" "$BR_B"
    printf '  "subnet_a": "%s.0/24",\n  "subnet_b": "%s.0/24",\n  "cpus": %d,\n  "script": "%s",\n  "nodes": [' \
        "$NET_A" "$NET_B" "$CPUS" "$HERE/setup-slurm.sh"
    for ((i = 0; i < NODES; i++)); do
        printf '%s\n    {"name": "%s", "netns": "%s", "addr_a": "%s", "iface_a": "%s", "addr_b": "%s", "iface_b": "%s", "log": "%s", "pidfile": "%s"}' \
            "$sep" "$(node_name "$i")" "$(node_ns "$i")" "$(addr_a "$i")" "${IFACES_A[$i]}" "$(addr_b "$i")" "${IFACES_B[$i]}" \
            "$(slurmd_log "$i")" "$(slurmd_pidfile "$i")"
        sep=,
    done
    printf '\n  ]\n}\n'
}

CONFIG_CHANGED=0
configure() {
    local new
    mkdir -p "$CONF_DIR" "$STATE/ctld" "$LOGS" "$RUN"
    for ((i = 0; i < NODES; i++)); do mkdir -p "$STATE/node/$(node_name "$i")"; done
    new=$(cgroup_conf)
    if [ "$(cat "$CGROUP_CONF" 2>/dev/null || true)" != "$new" ]; then
        printf '%s\n' "$new" >"$CGROUP_CONF"
        chmod 644 "$CGROUP_CONF"
        CONFIG_CHANGED=1
    fi
    new=$(slurm_conf)
    if [ "$(cat "$CONF" 2>/dev/null || true)" != "$new" ]; then
        printf '%s\n' "$new" >"$CONF"
        chmod 644 "$CONF"
        CONFIG_CHANGED=1
        note "wrote $CONF ($NODES nodes x $CPUS CPUs, partition $PARTITION, proctrack/$PROCTRACK)"
    fi
    testbed_json >"$TESTBED_JSON.tmp" && mv "$TESTBED_JSON.tmp" "$TESTBED_JSON"
}

# --- daemons ---------------------------------------------------------------------------------

ctld_answers() { timeout 10 scontrol ping 2>/dev/null | grep -q 'is UP'; }
start_ctld() {
    local pid started args=()
    pid=$(ctld_pid || true)
    if [ -n "$pid" ] && [ $CONFIG_CHANGED = 0 ] && ctld_answers; then note "slurmctld runs (pid $pid)"; return 0; fi
    [ -z "$pid" ] || stop_pid "$pid" slurmctld
    # a test cluster's jobs do not outlive its controller: whatever state the last one saved (jobs
    # of a machine that rebooted hold their nodes as "mix" for ever; a changed node list does not
    # match) is cleared
    args=(-c)
    note "starting slurmctld ${args[*]}"
    (cd / && exec /usr/sbin/slurmctld "${args[@]}" </dev/null >>"$SETUP_LOG" 2>&1 8>&-) \
        || { log_tail "$LOGS/slurmctld.log" "$SETUP_LOG"; fail "slurmctld did not start"; }
    started=$(date +%s)
    until ctld_answers; do
        if [ -z "$(ctld_pid || true)" ] && [ $(( $(date +%s) - started )) -ge 3 ]; then
            log_tail "$LOGS/slurmctld.log"; fail "slurmctld exited right after it started"
        fi
        [ $(( $(date +%s) - started )) -lt "$WAIT" ] || { log_tail "$LOGS/slurmctld.log"; fail "slurmctld did not answer within ${WAIT}s"; }
        sleep 0.2
    done
    note "slurmctld up (pid $(ctld_pid || echo '?'))"
}

launch_slurmd() {  # launch_slurmd N: start node N's slurmd in its namespaces (it daemonises itself)
    local i=$1 name
    name=$(node_name "$i")
    # ip netns exec: the node's network (and a private /sys); unshare --uts: hostname sN.
    # The mount namespace stays shared with this host, as a cluster file system would.
    (cd / && exec ip netns exec "$(node_ns "$i")" unshare --uts -- \
        sh -c "hostname $name && exec /usr/sbin/slurmd -N $name" </dev/null >>"$SETUP_LOG" 2>&1 8>&-) \
        || { log_tail "$(slurmd_log "$i")" "$SETUP_LOG"; fail "slurmd of $name did not start"; }
}

node_state() { timeout 10 sinfo -h -N -n "$1" -o '%t' 2>/dev/null | head -n1; }
node_idle() { [ "$(node_state "$1")" = idle ]; }
node_answers() {  # registered and responding: not down, not unknown, no '*' (not responding)
    local s
    s=$(node_state "$1")
    [ -n "$s" ] && [[ $s != *'*'* ]] && [[ $s != unk* ]] && [[ $s != down* ]]
}

start_slurmd() {  # start_slurmd N [restart]: make node N's slurmd run and the node usable
    local i=$1 restart=${2:-0} pid name s
    name=$(node_name "$i")
    pid=$(slurmd_pid "$i" || true)
    if [ -n "$pid" ] && [ "$restart" = 1 ]; then
        stop_pid "$pid" slurmd
        pid=
    fi
    if [ -z "$pid" ]; then
        # a slurmd outside the namespace, under this pid file: a stale one
        local stale
        stale=$(pid_from "$(slurmd_pidfile "$i")" slurmd || true)
        [ -z "$stale" ] || stop_pid "$stale" slurmd
        note "starting slurmd on $name ($(addr_a "$i"), $(node_ns "$i"))"
        launch_slurmd "$i"
    fi
}

wait_nodes() {  # wait_nodes N...: until each node answers; resume a down one; then until idle
    local i name s
    for i in "$@"; do
        name=$(node_name "$i")
        if ! poll "$WAIT" slurmd_pid "$i" >/dev/null; then
            log_tail "$(slurmd_log "$i")"; fail "slurmd of $name is not running"
        fi
        s=$(node_state "$name")
        if [[ $s == down* ]] || [[ $s == drain* ]] || [[ $s == drng* ]] || [[ $s == *'*'* ]] || [[ $s == unk* ]]; then
            poll 15 node_answers "$name" || true
            s=$(node_state "$name")
            if [[ $s == down* ]] || [[ $s == drain* ]] || [[ $s == drng* ]]; then
                note "$name is $s; resuming it"
                timeout 10 scontrol update NodeName="$name" State=RESUME >&2 || true
            fi
        fi
    done
    for i in "$@"; do
        name=$(node_name "$i")
        if ! node_idle "$name" && [ -n "$(timeout 10 squeue -h -w "$name" -o %i 2>/dev/null)" ]; then
            # a test cluster's set-up: jobs left on it by an earlier run (a killed test) go
            note "$name is $(node_state "$name") with jobs of an earlier run: cancelling them"
            # shellcheck disable=SC2046  # one word per job id
            timeout 20 scancel --full --quiet $(timeout 10 squeue -h -w "$name" -o %i) 2>/dev/null || true
        fi
        if ! poll "$WAIT" node_idle "$name"; then
            timeout 10 sinfo -N -l >&2 || true
            timeout 10 scontrol show node "$name" >&2 || true
            log_tail "$(slurmd_log "$i")" "$LOGS/slurmctld.log"
            fail "node $name is not idle after ${WAIT}s (state: $(node_state "$name"); jobs: $(timeout 10 squeue -h -o '%i %T %N' 2>/dev/null | tr '\n' ';'))"
        fi
    done
}

smoke() {
    [ "$SMOKE" = 1 ] || return 0
    local t0 out want got i
    t0=$(date +%s.%N)
    if ! out=$(cd / && timeout "$WAIT" srun -N "$NODES" -n "$NODES" -J pslaunch_setup_smoke hostname 2>&1); then
        echo "$out" >&2
        log_tail "$LOGS/slurmctld.log"
        fail "the smoke step (srun -N$NODES hostname) failed"
    fi
    want=$(for ((i = 0; i < NODES; i++)); do node_name "$i"; done | sort)
    got=$(sort <<<"$out")
    [ "$got" = "$want" ] || fail "the smoke step ran on '$(tr '\n' ' ' <<<"$got")', not on '$(tr '\n' ' ' <<<"$want")'"
    note "smoke step (srun -N$NODES hostname) ran in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')s"
}

# --- commands ---------------------------------------------------------------------------------

check_settings() {
    [[ $NODES =~ ^[1-8]$ ]] || fail "PSLAUNCH_SLURM_NODES must be 1..8"
    [[ $CPUS =~ ^[1-9][0-9]*$ ]] || fail "PSLAUNCH_SLURM_CPUS must be a positive integer"
    [[ $PARTITION =~ ^[A-Za-z0-9_-]+$ ]] || fail "PSLAUNCH_SLURM_PARTITION must be a plain name"
    [[ $PROCTRACK =~ ^(linuxproc|pgid)$ ]] || fail "PSLAUNCH_SLURM_PROCTRACK must be linuxproc or pgid"
    [[ $WAIT =~ ^[1-9][0-9]*$ ]] || fail "PSLAUNCH_SLURM_WAIT must be a positive number of seconds"
    [[ $SLURMD_TIMEOUT =~ ^[1-9][0-9]*$ ]] && [ "$SLURMD_TIMEOUT" -ge 3 ] \
        || fail "PSLAUNCH_SLURM_SLURMD_TIMEOUT must be a number of seconds, at least 3"
}

do_start() {
    [ "$(id -u)" = 0 ] || fail "run as root (installs packages, network namespaces, daemons)"
    check_settings
    trap cleanup EXIT
    mkdir -p "$LOGS" "$RUN"
    install_packages
    local t
    for t in /usr/sbin/slurmctld /usr/sbin/slurmd /usr/sbin/munged; do [ -x "$t" ] || fail "$t is missing after the install"; done
    for t in srun sinfo scontrol ip unshare; do command -v "$t" >/dev/null || fail "$t not found"; done
    network
    hosts_file
    configure
    start_munge
    start_ctld
    local i
    for ((i = 0; i < NODES; i++)); do start_slurmd "$i" "$CONFIG_CHANGED"; done
    wait_nodes $(seq 0 $((NODES - 1)))
    smoke
    note "Slurm ready: $NODES nodes in partition $PARTITION"
    print_env
}

do_stop() {
    local pid i ns
    if ctld_pid >/dev/null && ctld_answers; then
        if [ -n "$(timeout 10 squeue -h -o %i 2>/dev/null)" ]; then
            note "cancelling every job"
            # shellcheck disable=SC2046  # one word per job id
            timeout 20 scancel --full --quiet $(timeout 10 squeue -h -o %i) 2>/dev/null || true
            poll 15 test -z "$(timeout 10 squeue -h -o %i 2>/dev/null)" || true
        fi
    fi
    for ((i = 0; i < 8; i++)); do
        pid=$(slurmd_pid "$i" || true)
        [ -z "$pid" ] || stop_pid "$pid" slurmd
    done
    pid=$(ctld_pid || true)
    [ -z "$pid" ] || stop_pid "$pid" slurmctld
    pid=$(munged_pid || true)
    [ -z "$pid" ] || stop_pid "$pid" munged
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep '^psslurm-sn' || true); do
        remove_node_net "${ns#psslurm-sn}"
    done
    ip link del "$BR_A" 2>/dev/null || true
    ip link del "$BR_B" 2>/dev/null || true
    remove_hosts
    note "stopped"
}

do_reset() {
    do_stop
    note "wiping $STATE, $LOGS and $CONF"
    rm -rf "${STATE:?}" "${LOGS:?}" "${RUN:?}"
    rm -f "$CONF" "$CGROUP_CONF"
}

do_status() {
    local i
    echo "munged:    $(munged_pid || echo 'not running')"
    echo "slurmctld: $(ctld_pid || echo 'not running')"
    for ((i = 0; i < NODES; i++)); do
        echo "slurmd $(node_name "$i") ($(node_ns "$i"), $(addr_a "$i")): $(slurmd_pid "$i" || echo 'not running')"
    done
    if ctld_pid >/dev/null; then
        timeout 10 sinfo -N -o '%N %P %t %c %m %E' || true
        timeout 10 squeue || true
    fi
}

do_node() {  # do_node VERB NAME
    local verb=$1 i pid name
    [ -n "${2:-}" ] || fail "usage: $0 $verb NODE (sn0..sn$((NODES - 1)))"
    i=$(node_index "$2"); name=$2
    case $verb in
        node-stop)
            pid=$(slurmd_pid "$i" || true)
            [ -n "$pid" ] || { note "slurmd of $name does not run"; return 0; }
            stop_pid "$pid" slurmd ;;
        node-kill)
            note "SIGKILL to every process on $name"
            kill_ns "$(node_ns "$i")" ;;
        node-start)
            check_settings
            node_net_ok "$i" || fail "node $name's network is missing: run $0 start"
            ctld_answers || fail "slurmctld does not answer: run $0 start"
            start_slurmd "$i"
            wait_nodes "$i"
            note "$name is idle" ;;
    esac
}

# one invocation at a time (a CI step and a test's node-start, say)
lock() {
    mkdir -p "$RUN"
    exec 8>"$RUN/setup.lock"
    flock -w 300 8 || fail "another scripts/setup-slurm.sh holds $RUN/setup.lock"
}

case ${1:-start} in
    start|stop|reset|node-stop|node-kill|node-start) lock ;;
esac
case ${1:-start} in
    start) do_start ;;
    env) print_env ;;
    status) do_status ;;
    stop) do_stop ;;
    reset) do_reset ;;
    node-stop|node-kill|node-start) do_node "$1" "${2:-}" ;;
    -h|--help|help) sed -n '2,/^set -euo/{/^set -euo/!s/^# \{0,1\}//p}' "$0" ;;
    *) fail "unknown command '$1': use start, env, status, stop, reset, node-stop, node-kill or node-start" ;;
esac
