#!/usr/bin/env bash
# setup-sge.sh - a one-node (Son of) Grid Engine 8.1.9 for the `--launcher sge`
# tests, from Debian's packages. Runs as root; idempotent.
#
#   scripts/setup-sge.sh [start]  install what is missing, configure, start
#                                 sge_qmaster and sge_execd, wait until a job runs,
#                                 then print the `export` lines below on stdout
#   scripts/setup-sge.sh env      print the `export` lines only
#   scripts/setup-sge.sh status   daemons and `qstat -f`
#   scripts/setup-sge.sh stop     delete every job, stop both daemons
#   scripts/setup-sge.sh reset    stop, then wipe the cluster's state (the next
#                                 start rebuilds it)
#
# Progress goes to stderr and stdout carries only `export NAME=VALUE` lines:
#     eval "$(scripts/setup-sge.sh)"
# exports SGE_ROOT, SGE_CELL, DRMAA_LIBRARY_PATH and GLIBC_TUNABLES (see below).
#
# Settings (environment): SGE_SLOTS (8), SGE_QUEUE (all.q), SGE_WAIT_TIMEOUT (60 s
# per daemon), SGE_SMOKE_TEST (1: run `qsub -sync y /bin/true` at the end).
#
# What it solves that a plain `apt-get install gridengine-*` does not:
#  1. Host name: when 127.0.0.1 reverse-resolves to `localhost` but the host calls
#     itself something else, the qmaster refuses every client ("access denied
#     (client IP resolved to host name ...)"). SGE's host_aliases file maps the
#     names to one canonical name; it must exist before the daemons start.
#  2. Debian's cluster refuses uid/gid < 1000; CI runs as root: min_uid/min_gid 0.
#  3. libdrmaa links libjemalloc, whose initial-exec TLS cannot be dlopen()ed into
#     a running Python ("cannot allocate memory in static TLS block") unless the
#     process starts with GLIBC_TUNABLES=glibc.rtld.optional_static_tls=8192.
#  4. libdrmaa (unlike Debian's qstat/qsub wrappers) needs SGE_ROOT set.
#  Also: there is no init system here and postinst must not start daemons before
#  host_aliases exists, the default 15 s scheduling interval is set to 1 s, and
#  load thresholds are off so a busy 2-core box never puts the queue in alarm.
set -euo pipefail

SGE_ROOT=/var/lib/gridengine            # fixed by the Debian packages
SGE_CELL=default
export SGE_ROOT SGE_CELL
readonly SPOOL=/var/spool/gridengine
readonly COMMON=$SGE_ROOT/$SGE_CELL/common
readonly UTILBIN=/usr/lib/gridengine
readonly DRMAA_LIB=/usr/lib/gridengine-drmaa/lib/libdrmaa.so.1.0
readonly SETUP_LOG=/var/log/pslaunch-sge-setup.log
readonly STATIC_TLS=glibc.rtld.optional_static_tls=8192

SLOTS=${SGE_SLOTS:-8}
QUEUE=${SGE_QUEUE:-all.q}
WAIT=${SGE_WAIT_TIMEOUT:-60}
SMOKE=${SGE_SMOKE_TEST:-1}

# mailutils provides mailx without an MTA daemon (bsd-mailx would pull in exim4).
PACKAGES=(gridengine-common gridengine-client gridengine-master gridengine-exec
          gridengine-drmaa1.0 mailutils)

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# apt_install (serialised with the other scripts/deps steps), log, die
# shellcheck source=deps/lib.sh
source "$HERE/deps/lib.sh"
T0=$(date +%s.%N)
note() { printf '[setup-sge %5.1fs] %s\n' "$(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')" "$*" >&2; }
fail() { printf '[setup-sge] ERROR: %s\n' "$*" >&2; exit 1; }

# --- processes ----------------------------------------------------------------

# alive PID NAME: PID runs (not a zombie: PID 1 here reaps late) and is NAME.
alive() {
    local pid=$1 name=$2 state
    [[ $pid =~ ^[0-9]+$ ]] && [ -r "/proc/$pid/stat" ] || return 1
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ] || return 1
    state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
    [ "$state" != Z ] && [ "$state" != X ]
}
daemon_pid() {  # daemon_pid NAME PIDFILE-GLOB: the live daemon's pid, if any
    local name=$1 f p
    for f in $2; do
        p=$(cat "$f" 2>/dev/null) || continue
        if alive "$p" "$name"; then echo "$p"; return 0; fi
    done
    return 1
}
qmaster_pid() { daemon_pid sge_qmaster "$SPOOL/qmaster/qmaster.pid"; }
# the execd's spool directory is named after the unaliased host name: glob it
execd_pid() { daemon_pid sge_execd "$SPOOL/execd/*/execd.pid"; }

# poll SECONDS CMD...: run CMD every 0.25 s until it succeeds or time runs out
poll() {
    local end=$(( $(date +%s) + $1 )); shift
    until "$@"; do
        [ "$(date +%s)" -lt "$end" ] || return 1
        sleep 0.25
    done
}
gone() { ! alive "$1" "$2"; }
stop_daemon() {  # stop_daemon PID NAME: SIGTERM, then SIGKILL after 30 s
    local pid=$1 name=$2
    alive "$pid" "$name" || return 0
    note "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    kill -CONT "$pid" 2>/dev/null || true    # a stopped daemon cannot handle SIGTERM
    if ! poll 30 gone "$pid" "$name"; then
        note "$name ignored SIGTERM; SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        poll 10 gone "$pid" "$name" || fail "cannot stop $name (pid $pid)"
    fi
}
answers() { timeout 10 qstat >/dev/null 2>&1; }
log_tail() {  # log_tail FILE-GLOB...: the last lines of each daemon log, for errors
    local f
    for f in "$@"; do
        [ -s "$f" ] && { echo "--- $f" >&2; tail -n 15 "$f" >&2; }
    done
    return 0
}

print_env() {
    local tunables=${GLIBC_TUNABLES:-}
    [[ $tunables == *glibc.rtld.optional_static_tls=* ]] || tunables=${tunables:+$tunables:}$STATIC_TLS
    echo "export SGE_ROOT=$SGE_ROOT"
    echo "export SGE_CELL=$SGE_CELL"
    echo "export DRMAA_LIBRARY_PATH=$DRMAA_LIB"
    echo "export GLIBC_TUNABLES='$tunables'"
}

# --- install --------------------------------------------------------------------

POLICY_ADDED=0
WORK=
cleanup() {
    [ "$POLICY_ADDED" = 1 ] && rm -f /usr/sbin/policy-rc.d
    [ -n "$WORK" ] && rm -rf "$WORK"
    return 0
}

install() {
    local missing=0 p
    for p in "${PACKAGES[@]}"; do
        [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)" = "install ok installed" ] || missing=1
    done
    if [ $missing = 0 ]; then note "packages present"; return 0; fi
    # debconf answers: configure automatically, cell "default", master = this host
    local pkg
    for pkg in gridengine-common gridengine-client gridengine-master gridengine-exec; do
        echo "$pkg shared/gridengineconfig boolean true"
        echo "$pkg shared/gridenginecell string $SGE_CELL"
        echo "$pkg shared/gridenginemaster string $(hostname)"
    done | debconf-set-selections || fail "debconf-set-selections failed"
    # postinst must not start the daemons (host_aliases is not written yet)
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        POLICY_ADDED=1
    fi
    DEBIAN_FRONTEND=noninteractive dpkg --configure -a >>"$SETUP_LOG" 2>&1 || true
    note "installing ${PACKAGES[*]} (log: $SETUP_LOG)"
    apt_install "${PACKAGES[@]}" 2>>"$SETUP_LOG" || { tail -n 20 "$SETUP_LOG" >&2; fail "apt-get install failed"; }
    if [ "$POLICY_ADDED" = 1 ]; then rm -f /usr/sbin/policy-rc.d; POLICY_ADDED=0; fi
    note "packages installed"
}

# --- cluster files and host names ----------------------------------------------------

cluster_files() {
    id sgeadmin >/dev/null 2>&1 || fail "user sgeadmin is missing (did gridengine-common's postinst fail?)"
    local d
    for d in "$COMMON" "$SPOOL/qmaster/job_scripts" "$SPOOL/spooldb" "$SPOOL/execd" /var/run/gridengine; do
        mkdir -p "$d"
    done
    chown sgeadmin:sgeadmin "$SGE_ROOT" "$SGE_ROOT/$SGE_CELL" "$COMMON" "$SPOOL/qmaster" \
        "$SPOOL/qmaster/job_scripts" "$SPOOL/spooldb" "$SPOOL/execd" /var/run/gridengine
    [ -s "$COMMON/bootstrap" ] || \
        install -m 0644 -o sgeadmin -g sgeadmin /usr/share/gridengine/default-bootstrap "$COMMON/bootstrap"
    if [ ! -e "$SPOOL/spooldb/sge" ]; then   # never configured, or wiped by `reset`
        note "initialising the spool database"
        su -s /bin/sh sgeadmin -c \
            "/usr/share/gridengine/scripts/init_cluster $SGE_ROOT $SGE_CELL $SPOOL/spooldb sgeadmin" \
            >>"$SETUP_LOG" 2>&1 || { tail -n 20 "$SETUP_LOG" >&2; fail "init_cluster failed"; }
    fi
}

# host_aliases: first word = the name SGE uses, then every other name this host's
# addresses resolve back to. Worked out with SGE's own resolver utilities, so the
# result matches what the daemons will see on any /etc/hosts layout.
host_aliases() {
    local canonical addrs a back names=() n seen
    [ -x "$UTILBIN/gethostname" ] || fail "$UTILBIN/gethostname is missing (gridengine-client broken?)"
    canonical=$("$UTILBIN/gethostname" -name 2>/dev/null || true)
    [ -n "$canonical" ] || canonical=$(hostname)
    names=("$canonical")
    [ "$(hostname)" = "$canonical" ] || names+=("$(hostname)")
    addrs=$("$UTILBIN/gethostbyname" -all "$canonical" 2>/dev/null | awk -F': ' '/^Host Address/{print $2}')
    for a in $addrs; do
        back=$("$UTILBIN/gethostbyaddr" -name "$a" 2>/dev/null || true)
        [ -n "$back" ] || continue
        seen=0
        for n in "${names[@]}"; do [ "$n" = "$back" ] && seen=1; done
        [ $seen = 1 ] || names+=("$back")
    done
    if [ ${#names[@]} -gt 1 ]; then
        if [ "$(cat "$COMMON/host_aliases" 2>/dev/null || true)" != "${names[*]}" ]; then
            note "host_aliases: ${names[*]}"
            echo "${names[*]}" >"$COMMON/host_aliases"
            chown sgeadmin:sgeadmin "$COMMON/host_aliases"
            chmod 644 "$COMMON/host_aliases"
        fi
    elif [ -e "$COMMON/host_aliases" ]; then
        note "names resolve consistently; removing a stale host_aliases"
        rm -f "$COMMON/host_aliases"
    fi
    SGE_HOST=$("$UTILBIN/gethostname" -aname 2>/dev/null || true)
    [ -n "$SGE_HOST" ] || fail "cannot work out the host name Grid Engine uses"
    for a in $addrs; do
        back=$("$UTILBIN/gethostbyaddr" -aname "$a" 2>/dev/null || true)
        [ "$back" = "$SGE_HOST" ] || fail "$a resolves back to '$back', not '$SGE_HOST', even with host_aliases; fix /etc/hosts"
    done
}

# --- daemons --------------------------------------------------------------------------

QMASTER_STARTED=0
start_qmaster() {
    local pid started
    pid=$(qmaster_pid || true)
    if [ -n "$pid" ]; then
        if poll "$WAIT" answers; then note "sge_qmaster runs (pid $pid)"; return 0; fi
        note "sge_qmaster (pid $pid) does not answer; restarting it"
        stop_daemon "$pid" sge_qmaster
    fi
    host_aliases                        # the daemons read it at start only
    echo "$SGE_HOST" >"$COMMON/act_qmaster"
    chown sgeadmin:sgeadmin "$COMMON/act_qmaster"
    note "starting sge_qmaster"
    # It daemonises itself; detach its streams so `$(setup-sge.sh)` does not wait on it.
    (cd / && exec /usr/sbin/sge_qmaster </dev/null >>"$SETUP_LOG" 2>&1) \
        || { log_tail "$SPOOL/qmaster/messages" "$SETUP_LOG"; fail "sge_qmaster did not start"; }
    started=$(date +%s)
    until answers; do
        if [ -z "$(qmaster_pid || true)" ] && [ $(( $(date +%s) - started )) -ge 5 ]; then
            log_tail "$SPOOL/qmaster/messages" /tmp/qmaster_messages; fail "sge_qmaster exited right after it started"
        fi
        if [ $(( $(date +%s) - started )) -ge "$WAIT" ]; then
            log_tail "$SPOOL/qmaster/messages" /tmp/qmaster_messages; fail "sge_qmaster did not answer within ${WAIT}s"
        fi
        sleep 0.25
    done
    QMASTER_STARTED=1
    note "sge_qmaster up (pid $(qmaster_pid || echo '?'))"
}

queue_ready() {  # the queue instance exists, has a load value and is not unknown (u)
    local line
    line=$(timeout 10 qstat -f -q "$QUEUE@$SGE_HOST" 2>/dev/null | awk -v q="$QUEUE@$SGE_HOST" '$1 == q')
    [ -n "$line" ] && [ "$(awk '{print $4}' <<<"$line")" != "-NA-" ] && [[ $(awk '{print $6}' <<<"$line") != *u* ]]
}

start_execd() {
    local pid
    pid=$(execd_pid || true)
    if [ -n "$pid" ] && [ $QMASTER_STARTED = 1 ]; then
        # an execd that outlived its qmaster takes ~30 s to find the new one; a
        # restart takes ~2 s and its running jobs are picked up again
        note "restarting sge_execd (pid $pid) for the new sge_qmaster"
        stop_daemon "$pid" sge_execd
        pid=
    fi
    if [ -z "$pid" ]; then
        note "starting sge_execd"
        (cd / && exec /usr/sbin/sge_execd </dev/null >>"$SETUP_LOG" 2>&1) \
            || { log_tail "$SPOOL"/execd/*/messages "$SETUP_LOG"; fail "sge_execd did not start"; }
    fi
    if ! poll "$WAIT" queue_ready; then
        timeout 10 qstat -f >&2 || true
        log_tail "$SPOOL"/execd/*/messages /tmp/execd_messages
        fail "queue $QUEUE@$SGE_HOST was not usable within ${WAIT}s"
    fi
    timeout 10 qmod -c "$QUEUE@$SGE_HOST" >/dev/null 2>&1 || true   # clear an error state
    timeout 10 qmod -e "$QUEUE@$SGE_HOST" >/dev/null 2>&1 || true   # enable
    note "sge_execd up (pid $(execd_pid || echo '?')); $QUEUE@$SGE_HOST ready"
}

# --- configuration ------------------------------------------------------------------------

value_of() { awk -v k="$2" '$1 == k { $1 = ""; sub(/^ +/, ""); print; exit }' <<<"$1"; }
listed() { local item=$1 out; shift; out=$("$@" 2>/dev/null) || true; grep -qxF -- "$item" <<<"$out"; }

configure() {
    local conf
    # 2. let root submit
    conf=$(qconf -sconf global) || fail "qconf -sconf global failed"
    if [ "$(value_of "$conf" min_uid)" != 0 ] || [ "$(value_of "$conf" min_gid)" != 0 ]; then
        mkdir -p "$WORK/conf"
        # -Mconf takes the configuration's name from the file's name
        grep -v '^#' <<<"$conf" | sed -E 's/^(min_uid[[:space:]]+).*/\10/; s/^(min_gid[[:space:]]+).*/\10/' \
            >"$WORK/conf/global"
        qconf -Mconf "$WORK/conf/global" >&2
    fi
    # this host: administrative, submit and execution host
    listed "$SGE_HOST" qconf -sh || qconf -ah "$SGE_HOST" >&2
    listed "$SGE_HOST" qconf -ss || qconf -as "$SGE_HOST" >&2
    if ! listed "$SGE_HOST" qconf -sel; then
        printf '%s\n' "hostname $SGE_HOST" "load_scaling NONE" "complex_values NONE" "user_lists NONE" \
            "xuser_lists NONE" "projects NONE" "xprojects NONE" "usage_scaling NONE" \
            "report_variables NONE" >"$WORK/exechost"
        qconf -Ae "$WORK/exechost" >&2
    fi
    if ! qconf -shgrp @allhosts >/dev/null 2>&1; then
        printf 'group_name @allhosts\nhostlist %s\n' "$SGE_HOST" >"$WORK/allhosts"
        qconf -Ahgrp "$WORK/allhosts" >&2
    elif ! qconf -shgrp @allhosts | grep -qw -- "$SGE_HOST"; then
        qconf -aattr hostgroup hostlist "$SGE_HOST" @allhosts >&2
    fi
    # parallel environments for --worker-cores/--server-cores (-pe smp N)
    local pe
    for pe in smp make; do
        qconf -sp "$pe" >/dev/null 2>&1 || qconf -Ap "/usr/share/gridengine/util/resources/pe/$pe" >&2
    done
    # the queue
    local want=("hostlist=@allhosts" "load_thresholds=NONE" "pe_list=make smp" "slots=$SLOTS" "shell=/bin/bash")
    if ! listed "$QUEUE" qconf -sql; then
        qconf -sq | sed -E -e "s/^(qname[[:space:]]+).*/\1$QUEUE/" -e 's/^(hostlist[[:space:]]+).*/\1@allhosts/' \
            -e 's/^(load_thresholds[[:space:]]+).*/\1NONE/' -e 's/^(pe_list[[:space:]]+).*/\1make smp/' \
            -e "s/^(slots[[:space:]]+).*/\1$SLOTS/" -e 's#^(shell[[:space:]]+).*#\1/bin/bash#' >"$WORK/queue"
        qconf -Aq "$WORK/queue" >&2
    else
        local kv
        conf=$(qconf -sq "$QUEUE") || fail "qconf -sq $QUEUE failed"
        for kv in "${want[@]}"; do
            [ "$(value_of "$conf" "${kv%%=*}")" = "${kv#*=}" ] || qconf -mattr queue "${kv%%=*}" "${kv#*=}" "$QUEUE" >&2
        done
    fi
    # the scheduler: every second and on submit/finish, not every 15 s
    conf=$(qconf -ssconf) || fail "qconf -ssconf failed"
    if [ "$(value_of "$conf" schedule_interval)" != 0:0:1 ] || [ "$(value_of "$conf" flush_submit_sec)" != 1 ] \
        || [ "$(value_of "$conf" flush_finish_sec)" != 1 ]; then
        sed -E -e 's/^(schedule_interval[[:space:]]+).*/\10:0:1/' -e 's/^(flush_submit_sec[[:space:]]+).*/\11/' \
            -e 's/^(flush_finish_sec[[:space:]]+).*/\11/' <<<"$conf" >"$WORK/sconf"
        qconf -Msconf "$WORK/sconf" >&2
    fi
    note "configured: $QUEUE on $SGE_HOST, $SLOTS slots, PEs smp and make, root may submit"
}

smoke() {
    [ "$SMOKE" = 1 ] || return 0
    local t0 out
    t0=$(date +%s.%N)
    if ! out=$(timeout "$WAIT" qsub -b y -sync y -j y -o /dev/null -N pslaunch_setup_smoke -wd / /bin/true 2>&1); then
        echo "$out" >&2
        timeout 10 qstat -f >&2 || true
        log_tail "$SPOOL"/execd/*/messages
        fail "the smoke job (qsub -sync y /bin/true) failed"
    fi
    note "smoke job ran in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')s"
}

# --- commands -------------------------------------------------------------------------------

do_start() {
    [ "$(id -u)" = 0 ] || fail "run as root (installs packages, starts daemons)"
    [[ $SLOTS =~ ^[1-9][0-9]*$ ]] || fail "SGE_SLOTS must be a positive integer"
    trap cleanup EXIT
    WORK=$(mktemp -d)
    install
    [ -x /usr/sbin/sge_qmaster ] && [ -x /usr/sbin/sge_execd ] && command -v qconf >/dev/null \
        || fail "Grid Engine binaries missing after the install"
    [ -e "$DRMAA_LIB" ] || fail "$DRMAA_LIB is missing (package gridengine-drmaa1.0)"
    getent hosts "$(hostname)" >/dev/null \
        || fail "host name '$(hostname)' does not resolve; add '127.0.0.1 $(hostname)' to /etc/hosts"
    cluster_files
    SGE_HOST=$("$UTILBIN/gethostname" -aname 2>/dev/null || hostname)
    start_qmaster
    configure
    start_execd
    smoke
    note "Grid Engine ready"
    print_env
}

do_stop() {
    local qp ep h
    qp=$(qmaster_pid || true)
    ep=$(execd_pid || true)
    if [ -z "$qp$ep" ]; then note "no Grid Engine daemon runs"; return 0; fi
    if [ -n "$qp" ] && answers; then
        timeout 20 qdel -u '*' >/dev/null 2>&1 || true
        for h in $(qconf -sel 2>/dev/null); do timeout 20 qconf -kej "$h" >&2 2>&1 || true; done
        [ -z "$ep" ] || poll 30 gone "$ep" sge_execd || true
        timeout 20 qconf -km >&2 2>&1 || true
        poll 30 gone "$qp" sge_qmaster || true
    fi
    [ -z "$ep" ] || stop_daemon "$ep" sge_execd
    [ -z "$qp" ] || stop_daemon "$qp" sge_qmaster
    note "stopped"
}

do_reset() {
    do_stop
    note "wiping the spool and the cell's state"
    rm -rf "${SPOOL:?}/spooldb" "${SPOOL:?}/qmaster" "${SPOOL:?}/execd"
    rm -f "$COMMON/act_qmaster" "$COMMON/host_aliases" "$COMMON/accounting"
}

do_status() {
    echo "sge_qmaster: $(qmaster_pid || echo 'not running')"
    echo "sge_execd:   $(execd_pid || echo 'not running')"
    if qmaster_pid >/dev/null; then timeout 10 qstat -f || true; fi
}

case ${1:-start} in
    start) do_start ;;
    env) print_env ;;
    status) do_status ;;
    stop) do_stop ;;
    reset) do_reset ;;
    -h|--help|help) sed -n '2,/^set -euo/{/^set -euo/!s/^# \{0,1\}//p}' "$0" ;;
    *) fail "unknown command '$1': use start, env, status, stop or reset" ;;
esac
