# Helpers for scripts/deps/*.sh (sourced). Progress on stderr, exports on stdout.
set -euo pipefail
log() { printf '[deps] %s\n' "$*" >&2; }
die() { printf '[deps] ERROR: %s\n' "$*" >&2; exit 1; }

# apt_install PKG...: install missing Debian packages (one apt-get update per
# boot, serialised with a lock so parallel callers do not collide).
apt_install() {
    local missing=() p st
    for p in "$@"; do
        st=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null) || true
        [ "$st" = "install ok installed" ] || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    log "apt-get install ${missing[*]}"
    (
        flock 9
        if [ ! -e /tmp/.pslaunch-apt-updated ]; then
            DEBIAN_FRONTEND=noninteractive apt-get update -q >&2 && touch /tmp/.pslaunch-apt-updated
        fi
        local try
        for try in 1 2 3; do
            if DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
                -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "${missing[@]}" >&2; then
                exit 0
            fi
            log "apt-get failed (try $try/3)"; sleep 3
            DEBIAN_FRONTEND=noninteractive apt-get update -q >&2 || true
        done
        exit 1
    ) 9>/tmp/.pslaunch-apt.lock || die "apt-get install ${missing[*]} failed"
}

# test_venv DIR CHECK PIP-ARG...: make DIR (.venv-mxnet, ...) a virtualenv whose python passes
# `python -c CHECK`, with PIP-ARG... installed. These venvs serve only the tests, so they live
# in $PSLAUNCH_VENV_CACHE (default ~/.cache/pslaunch/venvs, one per Python and pins) and DIR
# links there: a fresh clone on the same machine (CI) reuses them instead of installing them
# again (a minute). A DIR of this checkout's own that passes CHECK is kept as it is.
# A PIP-ARG `;` splits them into pip installs run one after the other (torch first, then what
# needs it, under a constraint that keeps it).
test_venv() {
    local dir=$1 check=$2; shift 2
    if [ -d "$dir" ] && [ ! -L "$dir" ] && "$dir/bin/python" -c "$check" 2>/dev/null; then
        return 0
    fi
    local cache=${PSLAUNCH_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pslaunch/venvs}
    local key target
    key=$(printf '%s\n' "$(python3 --version 2>&1)" "$@" | sha256sum | cut -c1-12)
    target="$cache/${dir#.venv-}-$key"
    mkdir -p "$cache"
    (
        flock 9
        if ! "$target/bin/python" -c "$check" 2>/dev/null; then
            log "creating $target ($*)"
            rm -rf "$target"
            python3 -m venv "$target"
            local group=() arg
            for arg in "$@" ";"; do
                if [ "$arg" != ";" ]; then group+=("$arg"); continue; fi
                "$target/bin/python" -m pip install -q --disable-pip-version-check "${group[@]}" >&2
                group=()
            done
        fi
    ) 9>"$cache/.lock" || die "cannot create the venv $target"
    rm -rf "$dir"
    ln -s "$target" "$dir"
}

# require_users USER=PACKAGE...: each USER of an installed PACKAGE exists (getent passwd), else die
# with one line naming the missing user and the fix (a PACKAGE not installed yet is skipped: its
# install adds the user). A package's maintainer script adds its system user once; a later install
# that rewrites /etc/passwd (Chromium's dependency tree did, here) drops it again, and dpkg still
# says the package is installed, so apt_install does not run the script again: only a reinstall does.
require_users() {
    local pair user pkg
    for pair in "$@"; do
        user=${pair%%=*} pkg=${pair#*=}
        [ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)" = "install ok installed" ] || continue
        getent passwd "$user" >/dev/null \
            || die "system user '$user' is missing from /etc/passwd (an install rewrote it?): apt-get install --reinstall $pkg"
    done
}
