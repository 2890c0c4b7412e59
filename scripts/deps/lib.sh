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
