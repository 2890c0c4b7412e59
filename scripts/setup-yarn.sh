#!/usr/bin/env bash
# setup-yarn.sh - a one-node YARN testbed for the `--launcher yarn` tests, built from
# package registries only (Debian's JDK 17, and Hadoop's client jars from the pyspark
# package on PyPI). Runs as root; idempotent.
#
#   scripts/setup-yarn.sh [start]  install what is missing, build the testbed, start it,
#                                  wait until it answers, then print the `export` lines
#   scripts/setup-yarn.sh env      print the `export` lines only
#   scripts/setup-yarn.sh status   the testbed's process and `yarn application -list`
#   scripts/setup-yarn.sh stop     stop the testbed (it kills its containers first)
#   scripts/setup-yarn.sh reset    stop, then wipe its state (containers' files, logs, staging)
#
# Progress goes to stderr and stdout carries only `export NAME=VALUE` lines:
#     eval "$(scripts/setup-yarn.sh)"
# exports JAVA_HOME, HADOOP_HOME, HADOOP_CONF_DIR and PATH (with $HADOOP_HOME/bin first, so
# that `yarn` is Hadoop's, not the JavaScript package manager of the same name).
#
# What runs: tests/yarn_testbed/ (read its YarnTestbed.java), one Java process serving YARN's
# client, application-master and node-manager protocols over Hadoop's RPC, on 127.0.0.1. skein's
# real driver and application master run against it; containers are local process groups.
# Hadoop itself cannot be installed here (not in Debian; PyPI has only its client jars, inside
# pyspark), so the ResourceManager and NodeManager are the testbed's own; see docs/yarn.md.
#
# Settings (environment): YARN_TESTBED_HOME (/var/lib/pslaunch-yarn), PSLAUNCH_CACHE
# (/var/cache/pslaunch: the pyspark download, kept across runs), YARN_RM_PORT (8032),
# YARN_SCHEDULER_PORT (8030), YARN_NM_PORT (8041), YARN_WAIT_TIMEOUT (60 s),
# PSLAUNCH_PYTHON (.venv/bin/python: gets skein, the [yarn] extra, and runs pip download).
set -euo pipefail

readonly PYSPARK_VERSION=3.5.7   # its jars: Hadoop 3.3.4's shaded client, slf4j 2, log4j 2
readonly SKEIN_VERSION=0.8.2
readonly JDK_PACKAGE=openjdk-17-jdk-headless
readonly JAVA_HOME_17=/usr/lib/jvm/java-17-openjdk-amd64
# The jars the testbed, skein's driver and skein's application master need (AmIpFilter, which
# skein's web UI installs, is in hadoop-yarn-server-web-proxy).
readonly JARS=(hadoop-client-api hadoop-client-runtime hadoop-yarn-server-web-proxy slf4j-api jcl-over-slf4j
               log4j-api log4j-core log4j-1.2-api log4j-slf4j2-impl)

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
SRC=$REPO/tests/yarn_testbed
TB=${YARN_TESTBED_HOME:-/var/lib/pslaunch-yarn}
CACHE=${PSLAUNCH_CACHE:-/var/cache/pslaunch}
RM_PORT=${YARN_RM_PORT:-8032}
SCHEDULER_PORT=${YARN_SCHEDULER_PORT:-8030}
NM_PORT=${YARN_NM_PORT:-8041}
WAIT=${YARN_WAIT_TIMEOUT:-60}
PY=${PSLAUNCH_PYTHON:-$REPO/.venv/bin/python}
HADOOP=$TB/hadoop                 # HADOOP_HOME
CONF=$HADOOP/etc/hadoop           # HADOOP_CONF_DIR
LIB=$HADOOP/share/hadoop/client   # `yarn classpath`
TESTBED_JAR=$HADOOP/share/hadoop/testbed/yarn-testbed.jar
DATA=$TB/data
RUN=$TB/run
LOG=$RUN/testbed.log

# apt_install (serialised with the other scripts/deps steps)
# shellcheck source=deps/lib.sh
source "$HERE/deps/lib.sh"
T0=$(date +%s.%N)
note() { printf '[setup-yarn %5.1fs] %s\n' "$(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')" "$*" >&2; }
fail() { printf '[setup-yarn] ERROR: %s\n' "$*" >&2; exit 1; }

print_env() {
    echo "export JAVA_HOME=$JAVA_HOME_17"
    echo "export HADOOP_HOME=$HADOOP"
    echo "export HADOOP_CONF_DIR=$CONF"
    # shellcheck disable=SC2016  # $PATH expands where the line is eval'ed
    echo 'export PATH="'"$HADOOP/bin"':$PATH"'
}

# --- install and build --------------------------------------------------------------

# build_id: what the built files depend on; a change rebuilds them and restarts the testbed
build_id() {
    cat "$SRC"/src/pslaunch/yarntestbed/*.java "$SRC/yarn" "${BASH_SOURCE[0]}" | sha256sum | cut -c1-16
}

install_packages() {
    apt_install "$JDK_PACKAGE"
    [ -x "$JAVA_HOME_17/bin/javac" ] || fail "$JAVA_HOME_17/bin/javac is missing after installing $JDK_PACKAGE"
    if [ -x "$PY" ]; then
        if ! "$PY" -c 'import skein' 2>/dev/null; then
            note "installing skein==$SKEIN_VERSION (the [yarn] extra) into $PY"
            "$PY" -m pip install -q --disable-pip-version-check "skein==$SKEIN_VERSION" >&2
        fi
        # skein's TLS credentials in ~/.skein, minted once here rather than (with a warning) by
        # the first client
        "$PY" -W ignore -c 'import skein; skein.Security.from_default()' \
            || fail "skein could not write its credentials (~/.skein)"
    else
        note "no $PY (run scripts/setup.sh first): skein is not installed"
    fi
}

# Hadoop's client jars, from the pyspark source distribution on PyPI (downloaded once, then
# cached). It is never installed: only these jars are taken out of it.
client_jars() {
    local stamp=$LIB/.pyspark-$PYSPARK_VERSION sdist=$CACHE/pyspark-$PYSPARK_VERSION.tar.gz pip patterns=() j
    [ -e "$stamp" ] && return 0
    if [ ! -s "$sdist" ]; then
        if [ -x "$PY" ]; then pip=("$PY" -m pip); else pip=(python3 -m pip); fi
        "${pip[@]}" --version >/dev/null 2>&1 || fail "no pip to download pyspark with (run scripts/setup.sh first)"
        note "downloading pyspark==$PYSPARK_VERSION from PyPI (~320 MB, once; cached in $CACHE)"
        mkdir -p "$CACHE"
        "${pip[@]}" download -q --disable-pip-version-check --no-deps --no-binary :all: \
            -d "$CACHE" "pyspark==$PYSPARK_VERSION" >&2 || fail "pip download pyspark==$PYSPARK_VERSION failed"
        [ -s "$sdist" ] || fail "pip download did not leave $sdist"
    fi
    note "taking Hadoop's client jars out of $(basename "$sdist")"
    rm -rf "$LIB" && mkdir -p "$LIB"
    for j in "${JARS[@]}"; do patterns+=("pyspark-$PYSPARK_VERSION/deps/jars/$j-[0-9]*.jar"); done
    tar -xzf "$sdist" -C "$LIB" --strip-components=3 --wildcards "${patterns[@]}" \
        || fail "cannot extract the jars from $sdist"
    for j in "${JARS[@]}"; do compgen -G "$LIB/$j-[0-9]*.jar" >/dev/null || fail "$j is missing from $sdist"; done
    touch "$stamp"
}

write_conf() {
    mkdir -p "$CONF" "$DATA/fs/user" "$DATA/fs/tmp" "$DATA/tmp" "$DATA/nm-local-dir" "$DATA/nm-logs"
    prop() { printf '  <property><name>%s</name><value>%s</value></property>\n' "$1" "$2"; }
    # skein 0.8.2 cannot submit with fs.defaultFS=file:/// (its file-system comparison takes a null
    # host); a viewfs:// default with mount links onto the local disk is a real Hadoop FileSystem
    # that has a host part. Staging (~/.skein/<app id>, under /user) lands in $DATA/fs.
    {
        echo '<?xml version="1.0"?>'
        echo '<configuration>'
        prop fs.defaultFS viewfs://testbed/
        prop fs.viewfs.mounttable.testbed.link./user "file://$DATA/fs/user"
        prop fs.viewfs.mounttable.testbed.link./tmp "file://$DATA/fs/tmp"
        prop hadoop.tmp.dir "$DATA/tmp"
        echo '</configuration>'
    } >"$CONF/core-site.xml"
    {
        echo '<?xml version="1.0"?>'
        echo '<configuration>'
        prop yarn.resourcemanager.hostname 127.0.0.1
        prop yarn.resourcemanager.address "127.0.0.1:$RM_PORT"
        prop yarn.resourcemanager.scheduler.address "127.0.0.1:$SCHEDULER_PORT"
        prop yarn.nodemanager.address "127.0.0.1:$NM_PORT"
        prop yarn.nodemanager.local-dirs "$DATA/nm-local-dir"
        prop yarn.nodemanager.log-dirs "$DATA/nm-logs"
        prop yarn.nodemanager.resource.memory-mb 65536
        prop yarn.nodemanager.resource.cpu-vcores 64
        # the application master's classpath (skein's driver puts it in the master's CLASSPATH)
        prop yarn.application.classpath "$CONF,$LIB/*"
        # Masters heartbeat every expiry/2, at most every 5 s (skein): 1 s here. The testbed does
        # not expire masters itself.
        prop yarn.am.liveness-monitor.expiry-interval-ms 2000
        echo '</configuration>'
    } >"$CONF/yarn-site.xml"
    # log4j 2 finds this on the classpath ($CONF is on it): the testbed, skein's driver and master
    cat >"$CONF/log4j2.properties" <<'EOF'
status = error
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss.SSS} %p %c{1}: %m%n
rootLogger.level = info
rootLogger.appenderRef.console.ref = console
logger.hadoop.name = org.apache.hadoop
logger.hadoop.level = warn
logger.native.name = org.apache.hadoop.util.NativeCodeLoader
logger.native.level = error
EOF
}

build() {
    local id work
    id=$(build_id)
    if [ "$(cat "$HADOOP/BUILD" 2>/dev/null || true)" = "$id" ] && [ -s "$TESTBED_JAR" ]; then
        note "testbed built ($id)"
        return 0
    fi
    note "building the testbed ($id)"
    work=$(mktemp -d)
    "$JAVA_HOME_17/bin/javac" --release 11 -Xlint:-options -nowarn -cp "$LIB/*" -d "$work" \
        "$SRC"/src/pslaunch/yarntestbed/*.java >&2 || { rm -rf "$work"; fail "javac failed"; }
    mkdir -p "$(dirname "$TESTBED_JAR")" "$HADOOP/bin"
    "$JAVA_HOME_17/bin/jar" cf "$TESTBED_JAR" -C "$work" . || { rm -rf "$work"; fail "jar failed"; }
    rm -rf "$work"
    install -m 0755 "$SRC/yarn" "$HADOOP/bin/yarn"
    write_conf
    echo "$id" >"$HADOOP/BUILD"
}

# --- the daemon ------------------------------------------------------------------------

testbed_pid() {  # the running testbed's pid, if any
    local pid
    pid=$(cat "$RUN/testbed.pid" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] && [ -r "/proc/$pid/cmdline" ] || return 1
    grep -qa 'pslaunch.yarntestbed.YarnTestbed' "/proc/$pid/cmdline" || return 1
    echo "$pid"
}
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
answers() { port_open "$NM_PORT" && port_open "$SCHEDULER_PORT" && port_open "$RM_PORT"; }

stop_testbed() {
    local pid i
    pid=$(testbed_pid) || { note "the testbed does not run"; return 0; }
    note "stopping the testbed (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true   # its shutdown hook kills the containers
    for i in $(seq 1 100); do
        testbed_pid >/dev/null || break
        sleep 0.1
    done
    if testbed_pid >/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
    for i in $(seq 1 50); do   # the ports close with the process
        port_open "$RM_PORT" || port_open "$SCHEDULER_PORT" || port_open "$NM_PORT" || break
        sleep 0.1
    done
    rm -f "$RUN/testbed.pid" "$RUN/testbed.build"
}

start_testbed() {
    local pid id end
    id=$(cat "$HADOOP/BUILD")
    if pid=$(testbed_pid); then
        if [ "$(cat "$RUN/testbed.build" 2>/dev/null || true)" = "$id" ] && answers; then
            note "the testbed runs (pid $pid)"
            return 0
        fi
        note "the running testbed is out of date or does not answer: restarting it"
        stop_testbed
    fi
    local p
    for p in "$RM_PORT" "$SCHEDULER_PORT" "$NM_PORT"; do
        port_open "$p" && fail "port 127.0.0.1:$p is taken by another program (set YARN_RM_PORT, YARN_SCHEDULER_PORT, YARN_NM_PORT)"
    done
    mkdir -p "$RUN"
    note "starting the testbed (log: $LOG)"
    # Its own session, streams detached, so `$(setup-yarn.sh)` does not wait on it. Containers
    # inherit the NodeManager's environment, as on YARN: a service's clean one, whoever starts it.
    (cd "$RUN" && exec env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        LANG=C.UTF-8 HOME="$RUN" JAVA_HOME=$JAVA_HOME_17 HADOOP_HOME="$HADOOP" HADOOP_CONF_DIR="$CONF" \
        setsid "$JAVA_HOME_17/bin/java" -Xmx256m -cp "$CONF:$LIB/*:$TESTBED_JAR" \
        pslaunch.yarntestbed.YarnTestbed </dev/null >>"$LOG" 2>&1) &
    pid=$!   # setsid does not fork here: this becomes the JVM's pid
    echo "$pid" >"$RUN/testbed.pid"
    echo "$id" >"$RUN/testbed.build"
    end=$(( $(date +%s) + WAIT ))
    until answers; do
        # kill -0, not testbed_pid: until the exec chain (env, setsid) reaches java, the
        # process's command line is not the JVM's yet, and that is no failure
        if ! kill -0 "$pid" 2>/dev/null; then tail -n 30 "$LOG" >&2; fail "the testbed exited at start"; fi
        [ "$(date +%s)" -lt "$end" ] || { tail -n 30 "$LOG" >&2; fail "the testbed did not answer within ${WAIT}s"; }
        sleep 0.2
    done
    note "testbed up (pid $(testbed_pid)): ResourceManager 127.0.0.1:$RM_PORT, scheduler :$SCHEDULER_PORT, NodeManager :$NM_PORT"
}

smoke() {  # Hadoop's own YarnClient lists the applications
    local out
    out=$(JAVA_HOME=$JAVA_HOME_17 HADOOP_CONF_DIR=$CONF timeout "$WAIT" "$HADOOP/bin/yarn" application -list 2>&1) \
        || { echo "$out" >&2; fail "'yarn application -list' failed against the testbed"; }
    note "yarn application -list answers"
}

# --- commands ----------------------------------------------------------------------------

do_start() {
    [ "$(id -u)" = 0 ] || fail "run as root (installs packages, writes $TB)"
    install_packages
    client_jars
    build
    start_testbed
    smoke
    note "YARN testbed ready"
    print_env
}

do_status() {
    echo "testbed: $(testbed_pid || echo 'not running') ($TB)"
    if testbed_pid >/dev/null; then
        JAVA_HOME=$JAVA_HOME_17 HADOOP_CONF_DIR=$CONF "$HADOOP/bin/yarn" application -list -appStates ALL || true
    fi
}

case ${1:-start} in
    start) do_start ;;
    env) print_env ;;
    status) do_status ;;
    stop) stop_testbed ;;
    reset) stop_testbed; note "wiping $DATA"; rm -rf "${DATA:?}" ;;
    -h|--help|help) sed -n '2,/^set -euo/{/^set -euo/!s/^# \{0,1\}//p}' "$0" ;;
    *) fail "unknown command '$1': use start, env, status, stop or reset" ;;
esac
