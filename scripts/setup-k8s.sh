#!/usr/bin/env bash
# setup-k8s.sh - a loopback Kubernetes control plane for the `--launcher k8s` tests, built from
# Debian's own `kubernetes` source package with Debian's Go 1.19 and run against Debian's etcd
# (no Kubernetes server binary is packaged anywhere reachable: ../docs/k8s.md, "test cluster").
# Runs as root; idempotent.
#
#   scripts/setup-k8s.sh [start]  install what is missing, build (once per machine: cached), start
#                                 etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
#                                 wait until they answer, apply pslaunch's RBAC, print `export` lines
#   scripts/setup-k8s.sh build    install and build only (the binaries land in the cache)
#   scripts/setup-k8s.sh built    exit 0 if the binaries are cached (nothing to build)
#   scripts/setup-k8s.sh env      print the `export` lines only
#   scripts/setup-k8s.sh status   each component's process and health (exit 1 if one is down)
#   scripts/setup-k8s.sh stop     stop the components (by their pid files)
#   scripts/setup-k8s.sh reset    stop, then wipe the cluster's state (etcd data, PKI, logs)
#
# Progress goes to stderr and stdout carries only `export NAME=VALUE` lines:
#     eval "$(scripts/setup-k8s.sh)"
# exports PSLAUNCH_K8S_KUBECONFIG (pslaunch's service account: the rights a launcher needs, in
# namespace $K8S_NAMESPACE), PSLAUNCH_K8S_ADMIN_KUBECONFIG (system:masters, for the tests' own
# checks and clean-up) and PSLAUNCH_K8S_NAMESPACE.
#
# Everything listens on 127.0.0.1 only, every connection is TLS with certificates from a CA this
# script makes, and RBAC is on. The 3 nodes (kn0, kn1, kn2) are scripts/k8s_node.py, the project's
# stand-in for a kubelet, each with its own client certificate (system:node:knN): each Pod runs in
# a network namespace of its own with an address on the bridge psk8s (10.202.8.0/24, nothing but
# the Pods and this machine on it; node N hands out 10.202.8.(32*(N+1))/27).
#
# Settings (environment): K8S_TESTBED_HOME (/var/lib/pslaunch-k8s: PKI, etcd data, logs, pid
# files), PSLAUNCH_CACHE (/var/cache/pslaunch: the built binaries, kept across runs, keyed by the
# source version and the patch), K8S_ETCD_PORT (23790; peer port +10), K8S_APISERVER_PORT (16443),
# K8S_CM_PORT (20257), K8S_SCHED_PORT (20259), K8S_NAMESPACE (pslaunch), K8S_WAIT_TIMEOUT (90 s),
# K8S_BUILD_NICE (10: the Go build shares a 2-core machine), K8S_NODES (3), PSLAUNCH_PYTHON (the
# repository's .venv/bin/python: the node program needs the kubernetes client).
set -euo pipefail

# The source: Debian bookworm's `kubernetes` (upstream v1.20.2; bookworm builds only kubectl from
# it, the server commands are in its tarball). Pinned, so that a machine with the binaries cached
# needs no network at all.
readonly K8S_SRC_PACKAGE=kubernetes
readonly K8S_SRC_VERSION=1.20.5+really1.20.2-1.1+deb12u1
readonly K8S_ORIG=kubernetes_1.20.5+really1.20.2.orig.tar.gz
readonly K8S_TREE=kubernetes-1.20.2
# The one source fix: vendored modern-go/reflect2 1.0.1 assumes the runtime's pre-Go-1.18 map
# iterator, and kube-apiserver built with Go 1.19 dies (SIGSEGV) on every YAML or pretty-JSON
# response. Debian's reflect2 1.0.2 (the fixed upstream release) replaces that directory.
readonly REFLECT2_PACKAGE=golang-github-modern-go-reflect2-dev
readonly REFLECT2_VERSION=1.0.2-2
readonly GO_PACKAGE=golang-1.19-go
readonly GOROOT_119=/usr/lib/go-1.19
readonly ETCD_PACKAGE=etcd-server
readonly BINARIES=(kube-apiserver kube-controller-manager kube-scheduler)

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TB=${K8S_TESTBED_HOME:-/var/lib/pslaunch-k8s}
CACHE=${PSLAUNCH_CACHE:-/var/cache/pslaunch}
ETCD_PORT=${K8S_ETCD_PORT:-23790}
ETCD_PEER_PORT=$((ETCD_PORT + 10))
API_PORT=${K8S_APISERVER_PORT:-16443}
CM_PORT=${K8S_CM_PORT:-20257}
SCHED_PORT=${K8S_SCHED_PORT:-20259}
NS=${K8S_NAMESPACE:-pslaunch}
WAIT=${K8S_WAIT_TIMEOUT:-90}
NICE=${K8S_BUILD_NICE:-10}
NODES=${K8S_NODES:-3}
PY=${PSLAUNCH_PYTHON:-$(cd "$HERE/.." && pwd)/.venv/bin/python}
NODE_PROGRAM=$HERE/k8s_node.py
readonly BRIDGE=psk8s NET=10.202.8    # inside tests/netguard's allowed 10.202.0.0/16
KCACHE=$CACHE/k8s
PKI=$TB/pki
RUN=$TB/run
LOGS=$TB/logs
API=https://127.0.0.1:$API_PORT

# apt_install (serialised with the other scripts/deps steps)
# shellcheck source=deps/lib.sh
source "$HERE/deps/lib.sh"
T0=$(date +%s.%N)
note() { printf '[setup-k8s %5.1fs] %s\n' "$(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')" "$*" >&2; }
fail() { printf '[setup-k8s] ERROR: %s\n' "$*" >&2; exit 1; }

print_env() {
    echo "export PSLAUNCH_K8S_KUBECONFIG=$TB/pslaunch.kubeconfig"
    echo "export PSLAUNCH_K8S_ADMIN_KUBECONFIG=$TB/admin.kubeconfig"
    echo "export PSLAUNCH_K8S_NAMESPACE=$NS"
}

# --- install and build --------------------------------------------------------------

# build_key: what the binaries depend on (source version, patch, Go, the build steps below); a
# change builds them again into a directory of their own
build_key() {
    { echo "$K8S_SRC_VERSION $REFLECT2_VERSION $GO_PACKAGE"; declare -f fetch_source build_tree; } \
        | sha256sum | cut -c1-12
}

install_packages() {
    apt_install "$GO_PACKAGE" "$ETCD_PACKAGE"
    [ -x "$GOROOT_119/bin/go" ] || fail "$GOROOT_119/bin/go is missing after installing $GO_PACKAGE"
    command -v etcd >/dev/null || fail "etcd is missing after installing $ETCD_PACKAGE"
}

# fetch_source DIR: the orig tarball and Debian's reflect2 into DIR, through an apt state of our
# own (deb-src lines for the system's Debian mirror): the system's sources and lists stay as they are
fetch_source() {
    local dir=$1 opts
    local apt=$KCACHE/apt
    [ -s "$dir/$K8S_ORIG" ] && compgen -G "$dir/${REFLECT2_PACKAGE}_*.deb" >/dev/null && return 0
    mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/etc/sources.list.d" "$dir"
    cat >"$apt/etc/sources.list" <<'EOF'
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm-updates main
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian-security bookworm-security main
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main
EOF
    opts=(-q -o "Dir::Etc::SourceList=$apt/etc/sources.list" -o "Dir::Etc::SourceParts=$apt/etc/sources.list.d"
          -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache")
    note "fetching the $K8S_SRC_PACKAGE $K8S_SRC_VERSION source and $REFLECT2_PACKAGE $REFLECT2_VERSION (apt state in $apt)"
    apt-get "${opts[@]}" update >&2 || fail "apt-get update of the private deb-src lists ($apt) failed"
    (cd "$dir" && apt-get "${opts[@]}" source --download-only "$K8S_SRC_PACKAGE=$K8S_SRC_VERSION" >&2) \
        || fail "apt-get source $K8S_SRC_PACKAGE=$K8S_SRC_VERSION failed (is the pin in scripts/setup-k8s.sh still in the archive?)"
    (cd "$dir" && apt-get "${opts[@]}" download "$REFLECT2_PACKAGE=$REFLECT2_VERSION" >&2) \
        || fail "apt-get download $REFLECT2_PACKAGE=$REFLECT2_VERSION failed"
    [ -s "$dir/$K8S_ORIG" ] || fail "apt-get source did not leave $dir/$K8S_ORIG"
}

# build_tree SRC TREE: unpack, patch reflect2, `make` the three server commands (nice: the box has
# 2 cores that tests and other builds share)
build_tree() {
    local src=$1 tree=$2
    local r2=$src/reflect2 v=$tree/vendor/github.com/modern-go/reflect2
    rm -rf "$tree" "$r2" && mkdir -p "$(dirname "$tree")" "$r2"
    tar -xzf "$src/$K8S_ORIG" -C "$(dirname "$tree")" || fail "cannot unpack $K8S_ORIG"
    [ -d "$tree/cmd/kube-apiserver" ] || fail "$K8S_ORIG has no $K8S_TREE/cmd/kube-apiserver"
    dpkg-deb -x "$src"/${REFLECT2_PACKAGE}_*.deb "$r2"
    # only the .go and .s files: go.mod and vendor/modules.txt keep saying v1.0.1, so that
    # `-mod=vendor`'s consistency check still passes
    find "$v" -maxdepth 1 -type f \( -name '*.go' -o -name '*.s' \) -delete
    find "$r2/usr/share/gocode/src/github.com/modern-go/reflect2" -maxdepth 1 -type f \( -name '*.go' -o -name '*.s' \) \
        -exec cp {} "$v"/ \;
    [ -e "$v/go_above_118.go" ] || fail "$REFLECT2_PACKAGE $REFLECT2_VERSION did not give reflect2's Go >= 1.18 file"
    (
        cd "$tree"
        export PATH=$GOROOT_119/bin:$PATH HOME=$src/home TMPDIR=$src/tmp GOFLAGS= GO111MODULE=
        mkdir -p "$HOME" "$TMPDIR"
        nice -n "$NICE" /usr/bin/time -v -o "$src/build-time.txt" \
            make WHAT="cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler" >"$src/build.log" 2>&1
    ) || fail "the build failed: see $src/build.log"
}

have_binaries() {
    local b
    for b in "${BINARIES[@]}"; do [ -x "$BIN/$b" ] || return 1; done
}

build() {
    have_binaries && return 0
    install_packages
    local work=$KCACHE/build
    (
        flock 9
        have_binaries && exit 0
        fetch_source "$KCACHE/src-$K8S_SRC_VERSION"
        note "building ${BINARIES[*]} from $K8S_TREE with Go 1.19 under nice -n $NICE (5.5 min measured on 2 quiet cores, 15 on busy ones; once per machine)"
        rm -rf "$work" && mkdir -p "$work"
        cp "$KCACHE/src-$K8S_SRC_VERSION/$K8S_ORIG" "$KCACHE/src-$K8S_SRC_VERSION"/${REFLECT2_PACKAGE}_*.deb "$work"/
        local t=$SECONDS
        build_tree "$work" "$work/$K8S_TREE"
        rm -rf "$BIN.tmp" && mkdir -p "$BIN.tmp"
        for b in "${BINARIES[@]}"; do
            cp "$work/$K8S_TREE/_output/local/bin/linux/amd64/$b" "$BIN.tmp/" || fail "the build left no $b"
        done
        cp "$work/build-time.txt" "$BIN.tmp/"
        mv "$BIN.tmp" "$BIN"
        note "built in $((SECONDS - t)) s ($(awk -F': ' '/Maximum resident/{printf "peak RSS %.2f GB", $2/1e6}' "$work/build-time.txt")); dropping the 4 GB build tree"
        rm -rf "$work"
    ) 9>"$(mkdir -p "$KCACHE" && echo "$KCACHE/.build.lock")" || exit 1
    have_binaries || fail "no binaries in $BIN after the build"
}

# --- PKI and kubeconfigs ------------------------------------------------------------

# cert NAME SUBJECT [SAN]: a key and a certificate signed by the testbed's CA (kept if present);
# with a SAN it serves TLS too
cert() {
    local name=$1 subj=$2 san=${3:-}
    local ext=$PKI/$name.ext
    [ -s "$PKI/$name.crt" ] && return 0
    openssl genrsa -out "$PKI/$name.key" 2048 2>/dev/null
    openssl req -new -key "$PKI/$name.key" -subj "$subj" -out "$PKI/$name.csr" 2>/dev/null
    { echo "basicConstraints=CA:FALSE"; echo "keyUsage=critical,digitalSignature,keyEncipherment"
      if [ -n "$san" ]; then echo "extendedKeyUsage=serverAuth,clientAuth"; echo "subjectAltName=$san"
      else echo "extendedKeyUsage=clientAuth"; fi; } >"$ext"
    openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
        -days 3650 -sha256 -extfile "$ext" -out "$PKI/$name.crt" 2>/dev/null || fail "openssl could not sign $name"
    rm -f "$PKI/$name.csr" "$ext"
}

make_pki() {
    [ -s "$PKI/scheduler.crt" ] && return 0
    note "making the CA and certificates ($PKI)"
    mkdir -p "$PKI" && chmod 700 "$PKI"
    if [ ! -s "$PKI/ca.crt" ]; then
        openssl genrsa -out "$PKI/ca.key" 2048 2>/dev/null
        openssl req -x509 -new -key "$PKI/ca.key" -subj "/CN=pslaunch-k8s-ca" -days 3650 -sha256 \
            -out "$PKI/ca.crt" 2>/dev/null || fail "openssl could not make the CA"
    fi
    local lo="IP:127.0.0.1,DNS:localhost"
    cert etcd "/CN=etcd" "$lo"
    cert apiserver-etcd-client "/CN=kube-apiserver-etcd-client"
    cert apiserver "/CN=kube-apiserver" \
        "$lo,IP:10.96.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
    cert admin "/O=system:masters/CN=pslaunch-k8s-admin"
    cert controller-manager "/CN=system:kube-controller-manager"
    cert controller-manager-serving "/CN=kube-controller-manager" "$lo"
    cert scheduler-serving "/CN=kube-scheduler" "$lo"
    if [ ! -s "$PKI/sa.pub" ]; then
        openssl genrsa -out "$PKI/sa.key" 2048 2>/dev/null
        openssl rsa -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
    fi
    cert scheduler "/CN=system:kube-scheduler"   # last: make_pki's "done" mark
}

# node_certs: each node's client certificate, as a kubelet's (group system:nodes)
node_certs() {
    local i
    for ((i = 0; i < NODES; i++)); do
        cert "node-kn$i" "/O=system:nodes/CN=system:node:kn$i"
        kubeconfig "$TB/node-kn$i.kubeconfig" "node-kn$i"
    done
}

# kubeconfig FILE USER: with the client certificate PKI/USER.{crt,key};
# kubeconfig FILE USER token TOKEN: with a bearer token
kubeconfig() {
    local file=$1 user=$2 auth
    if [ "${3:-}" = token ]; then
        auth="    token: $4"
    else
        auth="    client-certificate-data: $(base64 -w0 "$PKI/$user.crt")
    client-key-data: $(base64 -w0 "$PKI/$user.key")"
    fi
    mkdir -p "$TB"
    (umask 077; printf '%s\n' "apiVersion: v1" "kind: Config" "clusters:" "- name: pslaunch-k8s" "  cluster:" \
        "    server: $API" "    certificate-authority-data: $(base64 -w0 "$PKI/ca.crt")" "users:" "- name: $user" \
        "  user:" "$auth" "contexts:" "- name: pslaunch-k8s" \
        "  context: {cluster: pslaunch-k8s, user: \"$user\", namespace: $NS}" \
        "current-context: pslaunch-k8s" >"$file.tmp")
    mv "$file.tmp" "$file"
}

# --- processes ----------------------------------------------------------------------

# pid_of NAME: the pid of the testbed's NAME if it runs (its pid file names a live process of NAME's binary)
pid_of() {
    local pid
    pid=$(cat "$RUN/$1.pid" 2>/dev/null) || return 1
    [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
    [ "$(basename "$(tr '\0' '\n' <"/proc/$pid/cmdline" | head -n 1)")" = "$1" ] && echo "$pid"
}

# launch NAME CMD...: start CMD in a session of its own, logging to LOGS/NAME.log, unless it runs
# already (from the same binary: one of another build, whose cache key changed, is replaced)
launch() {
    local name=$1 pid; shift
    if pid=$(pid_of "$name"); then
        tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "^$1 " && return 0
        note "$name runs another binary: restarting it"
        stop_one "$name"
    fi
    mkdir -p "$RUN" "$LOGS"
    setsid "$@" >>"$LOGS/$name.log" 2>&1 </dev/null 8>&- &  # 8: serialise's lock stays with this script
    echo $! >"$RUN/$name.pid"
}

# alive PID: it runs (an exited process waiting for init to reap it, state Z, does not)
alive() {
    local state
    state=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1
    [ -n "$state" ] && [ "$state" != Z ]
}

stop_one() {
    local pid i
    pid=$(pid_of "$1") || { rm -f "$RUN/$1.pid"; return 0; }
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 100); do alive "$pid" || break; sleep 0.1; done
    if alive "$pid"; then
        note "$1 ($pid) ignored SIGTERM for 10 s: SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$RUN/$1.pid"
}

# healthy NAME: its health endpoint answers, over TLS checked against the testbed's CA
healthy() {
    local url
    case $1 in
        etcd)
            curl -sf --max-time 5 --cacert "$PKI/ca.crt" --cert "$PKI/apiserver-etcd-client.crt" \
                --key "$PKI/apiserver-etcd-client.key" "https://127.0.0.1:$ETCD_PORT/health" | grep -q '"health":"true"'
            return ;;
        kube-apiserver) url=$API/readyz ;;
        kube-controller-manager) url=https://127.0.0.1:$CM_PORT/healthz ;;
        kube-scheduler) url=https://127.0.0.1:$SCHED_PORT/healthz ;;
    esac
    [ "$(curl -sf --max-time 5 --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" "$url")" = ok ]
}

# wait_healthy NAME: until healthy, or fail with the end of its log
wait_healthy() {
    local deadline=$((SECONDS + WAIT))
    until healthy "$1"; do
        pid_of "$1" >/dev/null || fail "$1 exited: $(tail -n 5 "$LOGS/$1.log" | tr '\n' ' ')"
        [ $SECONDS -lt $deadline ] || fail "$1 not healthy after ${WAIT}s: see $LOGS/$1.log"
        sleep 0.2
    done
}

start_etcd() {
    launch etcd "$(command -v etcd)" --name pslaunch-k8s --data-dir "$TB/etcd" \
        --listen-client-urls "https://127.0.0.1:$ETCD_PORT" --advertise-client-urls "https://127.0.0.1:$ETCD_PORT" \
        --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
        --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
        --initial-cluster "pslaunch-k8s=http://127.0.0.1:$ETCD_PEER_PORT" \
        --cert-file "$PKI/etcd.crt" --key-file "$PKI/etcd.key" --client-cert-auth --trusted-ca-file "$PKI/ca.crt"
    wait_healthy etcd
}

start_apiserver() {
    launch kube-apiserver "$BIN/kube-apiserver" \
        --etcd-servers "https://127.0.0.1:$ETCD_PORT" --etcd-cafile "$PKI/ca.crt" \
        --etcd-certfile "$PKI/apiserver-etcd-client.crt" --etcd-keyfile "$PKI/apiserver-etcd-client.key" \
        --bind-address 127.0.0.1 --secure-port "$API_PORT" --advertise-address 127.0.0.1 \
        --endpoint-reconciler-type none --cert-dir "$RUN/apiserver-certs" \
        --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" \
        --client-ca-file "$PKI/ca.crt" --authorization-mode Node,RBAC --profiling=false \
        --service-account-issuer https://kubernetes.default.svc --api-audiences https://kubernetes.default.svc \
        --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
        --service-cluster-ip-range 10.96.0.0/16
    wait_healthy kube-apiserver
}

# start_component NAME PORT KUBECONFIG SERVING-CERT ARG...: the controller-manager or the scheduler
start_component() {
    local name=$1 port=$2 cfg=$3 serving=$4; shift 4
    launch "$name" "$BIN/$name" --kubeconfig "$cfg" --authentication-kubeconfig "$cfg" \
        --authorization-kubeconfig "$cfg" --bind-address 127.0.0.1 --secure-port "$port" --port 0 \
        --tls-cert-file "$PKI/$serving.crt" --tls-private-key-file "$PKI/$serving.key" \
        --leader-elect=false --profiling=false "$@"
}

# --- the API, with the admin's certificate ------------------------------------------

# api METHOD PATH [JSON]: the response body on stdout, the HTTP status in the file $RUN/api-status
api() {
    local out
    out=$(curl -s --max-time 20 --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" \
        -H 'Content-Type: application/json' -H 'Accept: application/json' -X "$1" \
        ${3:+--data "$3"} -w '\n%{http_code}' "$API$2") || fail "curl $1 $2 failed"
    printf '%s' "${out##*$'\n'}" >"$RUN/api-status"
    printf '%s' "${out%$'\n'*}"
}

# ensure COLLECTION NAME JSON: create the object, or replace it (its rules change with the script)
ensure() {
    local body
    body=$(api POST "$1" "$3")
    case $(cat "$RUN/api-status") in
        201) ;;
        409)
            case $1 in
                */namespaces | */serviceaccounts) ;;  # kept: replacing a ServiceAccount drops its token
                *) body=$(api PUT "$1/$2" "$3")
                   [ "$(cat "$RUN/api-status")" = 200 ] || fail "PUT $1/$2: $body" ;;
            esac ;;
        *) fail "POST $1 ($2): HTTP $(cat "$RUN/api-status") $body" ;;
    esac
}

# The rights of pslaunch's service account: those of a launcher that creates one Pod per process,
# one headless Service and a ConfigMap (the parent of the job's objects), watches them, and reads
# the scheduler's Events and the Nodes, and creates and deletes each job's Secret (the task document).
# Nothing else: no reading of Secrets, nothing outside its namespace.
apply_rbac() {
    local rbac=/apis/rbac.authorization.k8s.io/v1 v1='"apiVersion":"rbac.authorization.k8s.io/v1"'
    local subject='"subjects":[{"kind":"ServiceAccount","name":"pslaunch","namespace":"'"$NS"'"}]'
    ensure /api/v1/namespaces "$NS" '{"apiVersion":"v1","kind":"Namespace","metadata":{"name":"'"$NS"'"}}'
    ensure "/api/v1/namespaces/$NS/serviceaccounts" pslaunch \
        '{"apiVersion":"v1","kind":"ServiceAccount","metadata":{"name":"pslaunch"}}'
    ensure "$rbac/namespaces/$NS/roles" pslaunch-launcher '{'"$v1"',"kind":"Role",
      "metadata":{"name":"pslaunch-launcher"},"rules":[
      {"apiGroups":[""],"resources":["pods"],"verbs":["create","get","list","watch","delete","deletecollection","patch"]},
      {"apiGroups":[""],"resources":["services"],"verbs":["create","get","list","watch","delete"]},
      {"apiGroups":[""],"resources":["configmaps"],"verbs":["create","get","list","watch","delete","update","patch"]},
      {"apiGroups":[""],"resources":["events"],"verbs":["get","list","watch"]},
      {"apiGroups":[""],"resources":["secrets"],"verbs":["create","delete"]}]}'
    ensure "$rbac/namespaces/$NS/rolebindings" pslaunch-launcher '{'"$v1"',"kind":"RoleBinding",
      "metadata":{"name":"pslaunch-launcher"},
      "roleRef":{"apiGroup":"rbac.authorization.k8s.io","kind":"Role","name":"pslaunch-launcher"},'"$subject"'}'
    # the nodes: the built-in system:node role (1.20 binds it to nobody), for the group of the
    # nodes' certificates
    ensure "$rbac/clusterrolebindings" pslaunch-test-nodes '{'"$v1"',"kind":"ClusterRoleBinding",
      "metadata":{"name":"pslaunch-test-nodes"},
      "roleRef":{"apiGroup":"rbac.authorization.k8s.io","kind":"ClusterRole","name":"system:node"},
      "subjects":[{"apiGroup":"rbac.authorization.k8s.io","kind":"Group","name":"system:nodes"}]}'
    ensure "$rbac/clusterroles" pslaunch-node-reader '{'"$v1"',"kind":"ClusterRole",
      "metadata":{"name":"pslaunch-node-reader"},
      "rules":[{"apiGroups":[""],"resources":["nodes"],"verbs":["get","list","watch"]}]}'
    ensure "$rbac/clusterrolebindings" "pslaunch-node-reader-$NS" '{'"$v1"',"kind":"ClusterRoleBinding",
      "metadata":{"name":"pslaunch-node-reader-'"$NS"'"},
      "roleRef":{"apiGroup":"rbac.authorization.k8s.io","kind":"ClusterRole","name":"pslaunch-node-reader"},'"$subject"'}'
}

# json_get EXPR: EXPR (Python, on the JSON document from stdin as `d`), or nothing if it fails
json_get() {
    python3 -c "import json, sys
try:
    d = json.load(sys.stdin); print($1)
except Exception:
    pass"
}

# pslaunch's kubeconfig: the token that the controller-manager's token controller puts in the
# service account's Secret (Kubernetes 1.20). Also waits for the namespace's `default`
# ServiceAccount: the apiserver refuses Pods until it exists.
service_account_kubeconfig() {
    local deadline=$((SECONDS + WAIT)) secret token=""
    while :; do
        secret=$(api GET "/api/v1/namespaces/$NS/serviceaccounts/pslaunch" | json_get "d['secrets'][0]['name']")
        if [ -n "$secret" ]; then
            token=$(api GET "/api/v1/namespaces/$NS/secrets/$secret" | json_get "d['data']['token']")
        fi
        api GET "/api/v1/namespaces/$NS/serviceaccounts/default" >/dev/null
        [ -n "$token" ] && [ "$(cat "$RUN/api-status")" = 200 ] && break
        [ $SECONDS -lt $deadline ] \
            || fail "no token for serviceaccount $NS/pslaunch (or no $NS/default) after ${WAIT}s: see $LOGS/kube-controller-manager.log"
        sleep 0.3
    done
    kubeconfig "$TB/pslaunch.kubeconfig" "system:serviceaccount:$NS:pslaunch" token "$(printf '%s' "$token" | base64 -d)"
}

# not_loopback: the testbed's listening sockets that are not on 127.0.0.1 (none, or it is a bug)
not_loopback() {
    local name pid
    for name in etcd kube-apiserver kube-controller-manager kube-scheduler; do
        pid=$(pid_of "$name") || continue
        ss -Hltnup | grep "pid=$pid," | awk '{print $5}' | grep -v '^127\.0\.0\.1:' | sed "s/^/$name /" || true
    done
}

# --- the nodes ----------------------------------------------------------------------

# network: the bridge the Pods' namespaces hang on (the node program makes those)
network() {
    if ! ip -o -4 addr show dev "$BRIDGE" 2>/dev/null | grep -q " $NET.1/24 "; then
        ip link show dev "$BRIDGE" >/dev/null 2>&1 || ip link add name "$BRIDGE" type bridge
        ip addr add "$NET.1/24" dev "$BRIDGE"
    fi
    ip link set "$BRIDGE" up
}

node_cmd() {  # node_cmd N: the node program's command line
    echo "$PY" "$NODE_PROGRAM" --kubeconfig "$TB/node-kn$1.kubeconfig" --name "kn$1" \
        --pod-cidr "$NET.$((32 * ($1 + 1)))/27" --prefix 24 --bridge "$BRIDGE" --gateway "$NET.1" --log-dir "$TB/pods"
}

# node_pid N: the pid of node N's program if it runs with today's command line
node_pid() {
    local pid
    pid=$(cat "$RUN/node-kn$1.pid" 2>/dev/null) || return 1
    [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
    [ "$NODE_PROGRAM" -nt "$RUN/node-kn$1.pid" ] && return 1  # the program changed since: restart it
    [ "$(tr '\0' ' ' <"/proc/$pid/cmdline")" = "$(node_cmd "$1") " ] && echo "$pid"
}

stop_node() {  # stop_node N (or any node program of that pid file: an older command line too)
    local pid i f=$RUN/node-kn$1.pid
    pid=$(cat "$f" 2>/dev/null) || return 0
    if [ -n "$pid" ] && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "k8s_node.py .*--name kn$1 "; then
        kill -TERM "$pid" 2>/dev/null || true
        for i in $(seq 150); do alive "$pid" || break; sleep 0.1; done
        alive "$pid" && { note "node kn$1 ($pid) ignored SIGTERM for 15 s: SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; }
    fi
    rm -f "$f"
}

# start_nodes: the node programs (one per node), then wait until every Node is Ready with a
# heartbeat from this start (a Node object outlives its program: Ready alone may be the last run's)
start_nodes() {
    local i deadline=$((SECONDS + WAIT)) ready since=$(($(date +%s) - 1)) launched=()
    "$PY" -c 'import kubernetes' 2>/dev/null \
        || fail "$PY has no kubernetes client: pip install -e '.[k8s]' (or set PSLAUNCH_PYTHON)"
    network
    node_certs
    for ((i = 0; i < NODES; i++)); do
        node_pid "$i" >/dev/null && { launched[i]=0; continue; }  # kept: Ready is enough
        launched[i]=$since
        stop_node "$i"
        mkdir -p "$RUN" "$LOGS" "$TB/pods"
        # shellcheck disable=SC2046
        setsid $(node_cmd "$i") >>"$LOGS/node-kn$i.log" 2>&1 </dev/null 8>&- &
        echo $! >"$RUN/node-kn$i.pid"
    done
    for ((i = 0; i < NODES; i++)); do
        until ready=$(api GET "/api/v1/nodes/kn$i" | json_get "[c['status'] == 'True' and __import__('datetime').datetime.fromisoformat(c['lastHeartbeatTime'].replace('Z', '+00:00')).timestamp() >= ${launched[i]} for c in d['status']['conditions'] if c['type'] == 'Ready'][0]") \
                && [ "$ready" = True ]; do
            node_pid "$i" >/dev/null || fail "node kn$i exited: $(tail -n 5 "$LOGS/node-kn$i.log" | tr '\n' ' ')"
            [ $SECONDS -lt $deadline ] || fail "node kn$i not Ready after ${WAIT}s: see $LOGS/node-kn$i.log"
            sleep 0.2
        done
    done
}

start() {
    build
    make_pki
    kubeconfig "$TB/admin.kubeconfig" admin
    kubeconfig "$TB/controller-manager.kubeconfig" controller-manager
    kubeconfig "$TB/scheduler.kubeconfig" scheduler
    start_etcd
    note "etcd answers"
    start_apiserver
    note "kube-apiserver answers"
    start_component kube-controller-manager "$CM_PORT" "$TB/controller-manager.kubeconfig" controller-manager-serving \
        --use-service-account-credentials --service-account-private-key-file "$PKI/sa.key" \
        --root-ca-file "$PKI/ca.crt" --cluster-signing-cert-file "$PKI/ca.crt" --cluster-signing-key-file "$PKI/ca.key"
    start_component kube-scheduler "$SCHED_PORT" "$TB/scheduler.kubeconfig" scheduler-serving
    wait_healthy kube-controller-manager
    wait_healthy kube-scheduler
    note "kube-controller-manager and kube-scheduler answer"
    apply_rbac
    service_account_kubeconfig
    note "RBAC applied, pslaunch's token written"
    start_nodes
    note "$NODES nodes Ready (kn0..kn$((NODES - 1)); Pods on $BRIDGE $NET.0/24)"
    local open
    open=$(not_loopback)
    [ -z "$open" ] || fail "listening beyond loopback: $open"
    note "up: $API (etcd, kube-apiserver, kube-controller-manager, kube-scheduler; logs in $LOGS)"
    print_env
}

status() {
    local name pid bad=0 open i
    for name in etcd kube-apiserver kube-controller-manager kube-scheduler; do
        if ! pid=$(pid_of "$name"); then
            echo "$name: not running"; bad=1
        elif healthy "$name"; then
            echo "$name: running (pid $pid, $(awk '/VmRSS/{print "rss", $2, $3}' "/proc/$pid/status")), healthy"
        else
            echo "$name: running (pid $pid), NOT healthy"; bad=1
        fi
    done
    for ((i = 0; i < NODES; i++)); do
        if pid=$(node_pid "$i"); then
            echo "node kn$i: running (pid $pid, $(awk '/VmRSS/{print "rss", $2, $3}' "/proc/$pid/status"))"
        elif pid=$(cat "$RUN/node-kn$i.pid" 2>/dev/null) && alive "$pid"; then
            echo "node kn$i: running (pid $pid) an older program or command line: start replaces it"; bad=1
        else
            echo "node kn$i: not running"; bad=1
        fi
    done
    open=$(not_loopback)
    [ -z "$open" ] || { echo "listening beyond loopback: $open"; bad=1; }
    return $bad
}

stop() {
    local name i
    for ((i = 0; i < NODES; i++)); do stop_node "$i"; done
    for name in kube-scheduler kube-controller-manager kube-apiserver etcd; do stop_one "$name"; done
}

# where the binaries of this source, patch and recipe live (set here: build_key reads the functions)
BIN=$KCACHE/bin-1.20.2-$(build_key)

# start, stop and reset one at a time (two test sessions may start the cluster at once)
serialise() { mkdir -p "$(dirname "$TB")"; exec 8>"$TB.lock"; flock 8; }

case "${1:-start}" in
    start) serialise; start ;;
    build) build ;;
    built) have_binaries ;;
    env) print_env ;;
    status) status ;;
    stop) serialise; stop ;;
    reset) serialise; stop; note "wiping $TB"; rm -rf "$TB"; ip link del "$BRIDGE" 2>/dev/null || true ;;
    *) fail "usage: $0 [start|build|built|env|status|stop|reset]" ;;
esac
