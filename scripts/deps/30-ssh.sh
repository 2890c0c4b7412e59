#!/usr/bin/env bash
# The ssh backend's tests: OpenSSH server and client, rsync (the --sync-dst-dir
# fast path), iproute2 and util-linux (network namespaces, unshare, nsenter).
# The test fixture (tests/support/testbed.py) builds the namespace hosts itself; this
# step only installs. No service is started: each testbed host runs its own sshd.
source "$(dirname "$0")/lib.sh"
apt_install openssh-server openssh-client rsync iproute2 util-linux procps
require_users sshd=openssh-server
# sshd refuses to start without its privilege-separation directory.
mkdir -p /run/sshd
chmod 0755 /run/sshd
command -v ip >/dev/null || die "ip (iproute2) not found"
[ -x /usr/sbin/sshd ] || die "/usr/sbin/sshd not found after installing openssh-server"
log "ssh: $(/usr/sbin/sshd -V 2>&1 | head -1 || true), $(rsync --version | head -1)"
