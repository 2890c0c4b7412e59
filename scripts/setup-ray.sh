#!/usr/bin/env bash
# setup-ray.sh - a three-node Ray cluster on this one machine (a head and two
# workers, each in its own network namespace with its own address), for the
# `--launcher ray` tests. Runs as root; idempotent.
#
#   scripts/setup-ray.sh [start]   build the namespaces, start the head, then each
#                                  worker, wait until the head lists every node,
#                                  write the testbed description and print the
#                                  `export` line below
#   scripts/setup-ray.sh env       print the `export` line only
#   scripts/setup-ray.sh status    each node's Ray processes and `ray status`
#   scripts/setup-ray.sh cost      start seconds (from the last start) and the RSS
#                                  of each node's processes, in MiB
#   scripts/setup-ray.sh stop      `ray stop` on every node, SIGKILL what is left
#                                  in the namespaces, remove them and the bridge
#
# Progress goes to stderr; stdout carries only `export NAME=VALUE` lines:
#     eval "$(scripts/setup-ray.sh)"
# exports PSLAUNCH_RAY_TESTBED (a JSON description of the nodes, for the tests).
#
# Layout (see docs/ray.md, "The test cluster"):
#   root namespace: bridge psray 10.202.5.1/24 (nothing of Ray listens here: not on eth0)
#   node rN (N = 0..2): network namespace psray-rN (and a UTS namespace: hostname rN), eth0 10.202.5.(10+N);
#     r0 is the head (GCS on port 6379); r1 and r2 join it. The file system is
#     shared: the nodes run Ray from this checkout's .venv, and a driver in the
#     head's namespace (`ip netns exec psray-r0 pslaunch --launcher ray ...`)
#     finds the head's raylet, as a driver on a real head node does.
# Small on purpose: --num-cpus 2 per node (logical slots, overcommitted on the
# 2-core machine), a 100 MB object store, no dashboard, no usage stats, no
# prestarted idle workers.
#
# Settings (environment): PSLAUNCH_RAY_PYTHON (this checkout's .venv/bin/python,
# which must have ray installed: pip install '.[ray]'), PSLAUNCH_RAY_CPUS (2 logical
# CPUs per node; `start` restarts a running cluster that has another number: the
# tests expect 2, scripts/bench_launch_ray.py asks for more), PSLAUNCH_RAY_WAIT
# (120 s per node).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
readonly NET=10.202.5 BR=psray NODES=3 PORT=6379   # inside tests/netguard's allowed 10.202.0.0/16
readonly STATE=/var/lib/pslaunch-ray
readonly TESTBED_JSON=$STATE/testbed.json
readonly TIMES=$STATE/start-times
readonly LOGS=/var/log/pslaunch-ray
readonly TEMP=/tmp/ray-pslaunch
PY=${PSLAUNCH_RAY_PYTHON:-$ROOT/.venv/bin/python}
CPUS=${PSLAUNCH_RAY_CPUS:-2}
WAIT=${PSLAUNCH_RAY_WAIT:-120}
OBJECT_STORE=$((100 * 1024 * 1024))

T0=$(date +%s.%N)
elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}'; }
note() { printf '[setup-ray %5ss] %s\n' "$(elapsed "$T0")" "$*" >&2; }
fail() { printf '[setup-ray] ERROR: %s\n' "$*" >&2; exit 1; }

node_ns() { echo "psray-r$1"; }
addr() { echo "$NET.$((10 + $1))"; }
head_address() { echo "$(addr 0):$PORT"; }
ns_pids() { ip netns pids "$1" 2>/dev/null || true; }
in_ns() { local i=$1; shift; ip netns exec "$(node_ns "$i")" "$@"; }
ray_cli() { local i=$1; shift; in_ns "$i" env RAY_USAGE_STATS_ENABLED=0 "$PY" -m ray.scripts.scripts "$@"; }
poll() {  # poll SECONDS CMD...: run CMD every 0.3 s until it succeeds or time runs out
    local end=$(( $(date +%s) + $1 )); shift
    until "$@"; do
        [ "$(date +%s)" -lt "$end" ] || return 1
        sleep 0.3
    done
}

print_env() { echo "export PSLAUNCH_RAY_TESTBED=$TESTBED_JSON"; }

# --- network ------------------------------------------------------------------------------

node_net_ok() {
    local ns i=$1
    ns=$(node_ns "$i")
    [ -e "/run/netns/$ns" ] || return 1
    ip -n "$ns" -o -4 addr show dev eth0 2>/dev/null | grep -q " $(addr "$i")/24 " || return 1
    ip -o link show dev "psray-$i" 2>/dev/null | grep -q "master $BR"
}
kill_ns() {  # kill_ns NS: SIGKILL every process in a network namespace, wait until none is left
    local ns=$1 pids
    pids=$(ns_pids "$ns")
    [ -n "$pids" ] || return 0
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
    poll 10 test -z "$(ns_pids "$ns")" || note "processes left in $ns: $(ns_pids "$ns" | tr '\n' ' ')"
}
network() {
    local i ns
    if ! ip -o -4 addr show dev "$BR" 2>/dev/null | grep -q " $NET.1/24 "; then
        ip link show dev "$BR" >/dev/null 2>&1 || ip link add name "$BR" type bridge
        ip addr add "$NET.1/24" dev "$BR"
    fi
    ip link set "$BR" up
    for ((i = 0; i < NODES; i++)); do
        node_net_ok "$i" && continue
        ns=$(node_ns "$i")
        [ -e "/run/netns/$ns" ] && { kill_ns "$ns"; ip netns del "$ns"; }
        ip link del "psray-$i" 2>/dev/null || true
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        ip link add "psray-$i" type veth peer name "psrayt-$i"
        ip link set "psrayt-$i" netns "$ns"
        ip -n "$ns" link set "psrayt-$i" name eth0
        ip link set "psray-$i" master "$BR" up
        ip -n "$ns" addr add "$(addr "$i")/24" dev eth0
        ip -n "$ns" link set eth0 up
    done
    # No default route (as on the ssh testbed's hosts): a node reaches the bridge's subnet and
    # nothing else, so what Ray itself tries beyond it (see guard_env) fails at once, unsent.
    for ((i = 0; i < NODES; i++)); do ip -n "$(node_ns "$i")" route del default 2>/dev/null || true; done
    note "network: bridge $BR $NET.1/24, nodes $(addr 0) (head), $(addr 1), $(addr 2)"
}

# --- Ray ------------------------------------------------------------------------------------

# alive_nodes: how many nodes the head's GCS counts as alive (0 when it does not answer)
alive_nodes() {
    in_ns 0 "$PY" - "$(head_address)" <<'EOF' 2>/dev/null || echo 0
import sys
from ray._raylet import GcsClient
nodes = GcsClient(address=sys.argv[1]).get_all_node_info(timeout=5)
print(sum(1 for n in nodes.values() if n.state == 0))
EOF
}
node_runs() {  # node_runs N: a raylet runs in node N's namespace
    local p
    for p in $(ns_pids "$(node_ns "$1")"); do
        [ "$(cat "/proc/$p/comm" 2>/dev/null)" = raylet ] && return 0
    done
    return 1
}
# guard_env: under the tests (PSLAUNCH_NETGUARD_LOG set: the cluster's Python processes inherit the
# tests' network guard, tests/netguard), the one address outside the test networks that Ray's head
# tries by itself: its dashboard process asks the cloud metadata address 169.254.169.254 which
# cloud it runs on (ray._common.usage.usage_lib, even with usage stats off), once, at start. With
# no route it fails at once and nothing leaves; without this the guard fails the session for it.
guard_env() {
    [ -n "${PSLAUNCH_NETGUARD_LOG:-}" ] || return 0
    echo "PSLAUNCH_NETGUARD_NETS=${PSLAUNCH_NETGUARD_NETS:-127.0.0.0/8,::1/128,10.200.0.0/16,10.201.0.0/16,10.202.0.0/16},169.254.169.254/32"
}
start_node() {  # start_node N: ray start in node N's namespace; wait until the head lists N+1 nodes
    local i=$1 t args
    t=$(date +%s.%N)
    args=(--node-ip-address "$(addr "$i")" --num-cpus "$CPUS" --num-gpus 0 --object-store-memory "$OBJECT_STORE"
          --disable-usage-stats --resources "{\"pslaunch_node_r$i\": 1}")
    if [ "$i" = 0 ]; then
        args+=(--head --port "$PORT" --include-dashboard=false --temp-dir "$TEMP")
    else
        args+=(--address "$(head_address)")
    fi
    note "starting node r$i ($(addr "$i")$([ "$i" = 0 ] && echo ", head"))"
    # its own UTS namespace too: hostname rN, as on a real cluster (the processes' labels say where they run)
    # shellcheck disable=SC2046 # (guard_env: one word or none)
    (cd / && exec ip netns exec "$(node_ns "$i")" unshare --uts -- env RAY_USAGE_STATS_ENABLED=0 \
        RAY_prestart_worker_first_driver=0 $(guard_env) "$PY" -c 'import socket, sys; socket.sethostname(sys.argv[1]);
from ray.scripts.scripts import main; sys.argv[1:2] = []; main()' "r$i" start "${args[@]}" \
        </dev/null >>"$LOGS/start-r$i.log" 2>&1) \
        || { tail -n 20 "$LOGS/start-r$i.log" >&2; fail "ray start failed on r$i (log: $LOGS/start-r$i.log)"; }
    want=$((i + 1))
    poll "$WAIT" test "$(alive_nodes)" -ge "$want" \
        || { tail -n 20 "$LOGS/start-r$i.log" >&2; fail "node r$i did not join within ${WAIT}s"; }
    echo "r$i $(elapsed "$t")" >>"$TIMES"
    note "node r$i is up ($(elapsed "$t") s)"
}
running_cpus() {  # the logical CPUs per node of the running cluster, as its last start wrote them
    sed -n 's/^  "cpus": \([0-9]*\),$/\1/p' "$TESTBED_JSON" 2>/dev/null || true
}
write_json() {
    local i sep=""
    mkdir -p "$STATE"
    {
        printf '{\n  "address": "%s",\n  "subnet": "%s.0/24",\n  "bridge": "%s.1",\n  "cpus": %d,\n' \
            "$(head_address)" "$NET" "$NET" "$CPUS"
        printf '  "python": "%s",\n  "script": "%s",\n  "nodes": [' "$PY" "$HERE/setup-ray.sh"
        for ((i = 0; i < NODES; i++)); do
            printf '%s\n    {"name": "r%d", "netns": "%s", "addr": "%s", "head": %s}' "$sep" "$i" "$(node_ns "$i")" \
                "$(addr "$i")" "$([ "$i" = 0 ] && echo true || echo false)"
            sep=,
        done
        printf '\n  ]\n}\n'
    } >"$TESTBED_JSON.tmp"
    mv "$TESTBED_JSON.tmp" "$TESTBED_JSON"
}

do_start() {
    local i all=1
    [ "$(id -u)" = 0 ] || fail "run as root (it makes network namespaces)"
    "$PY" -c 'import ray' 2>/dev/null || fail "$PY has no ray: .venv/bin/pip install '.[ray]' (scripts/setup.sh does)"
    mkdir -p "$LOGS" "$STATE"
    network
    for ((i = 0; i < NODES; i++)); do node_runs "$i" || all=0; done
    if [ $all = 1 ] && [ "$(running_cpus)" != "$CPUS" ]; then
        note "the cluster runs with $(running_cpus) CPUs per node, not $CPUS (PSLAUNCH_RAY_CPUS): restarting it"
        all=0
    fi
    if [ $all = 1 ] && [ "$(alive_nodes)" -ge "$NODES" ]; then
        note "the cluster runs ($NODES nodes)"
    else
        do_stop_ray
        : >"$TIMES"
        for ((i = 0; i < NODES; i++)); do start_node "$i"; done
    fi
    write_json
    note "ready: head $(head_address); $TESTBED_JSON"
    print_env
}

do_stop_ray() {
    local i
    for ((i = NODES - 1; i >= 0; i--)); do
        [ -e "/run/netns/$(node_ns "$i")" ] || continue
        if [ -n "$(ns_pids "$(node_ns "$i")")" ]; then
            ray_cli "$i" stop --grace-period 10 </dev/null >>"$LOGS/stop.log" 2>&1 || true
            kill_ns "$(node_ns "$i")"
        fi
    done
}

do_stop() {
    local i
    do_stop_ray
    for ((i = 0; i < NODES; i++)); do
        ip netns del "$(node_ns "$i")" 2>/dev/null || true
        ip link del "psray-$i" 2>/dev/null || true
    done
    ip link del "$BR" 2>/dev/null || true
    rm -f "$TESTBED_JSON"
    note "stopped"
}

rss_mib() {  # rss_mib NS: the summed RSS of every process in NS, in MiB
    local total=0 p kb
    for p in $(ns_pids "$1"); do
        kb=$(awk '/^VmRSS:/{print $2}' "/proc/$p/status" 2>/dev/null || true)
        total=$((total + ${kb:-0}))
    done
    echo $((total / 1024))
}
do_cost() {
    local i
    for ((i = 0; i < NODES; i++)); do
        printf 'r%d: start %ss, %d processes, RSS %d MiB\n' "$i" \
            "$(awk -v n="r$i" '$1 == n {print $2}' "$TIMES" 2>/dev/null || echo '?')" \
            "$(ns_pids "$(node_ns "$i")" | wc -l)" "$(rss_mib "$(node_ns "$i")")"
    done
}
do_status() {
    local i p
    for ((i = 0; i < NODES; i++)); do
        printf 'r%d (%s, %s):' "$i" "$(node_ns "$i")" "$(addr "$i")"
        for p in $(ns_pids "$(node_ns "$i")"); do printf ' %s(%s)' "$(cat "/proc/$p/comm" 2>/dev/null)" "$p"; done
        echo
    done
    echo "alive nodes: $(alive_nodes)"
}

lock() {
    mkdir -p "$STATE"
    exec 8>"$STATE/setup.lock"
    flock -w 300 8 || fail "another scripts/setup-ray.sh holds $STATE/setup.lock"
}

case ${1:-start} in
    start|stop) lock ;;
esac
case ${1:-start} in
    start) do_start ;;
    env) print_env ;;
    status) do_status ;;
    cost) do_cost ;;
    stop) do_stop ;;
    -h|--help|help) sed -n '2,/^set -euo/{/^set -euo/!s/^# \{0,1\}//p}' "$0" ;;
    *) fail "unknown command '$1': use start, env, status, cost or stop" ;;
esac
