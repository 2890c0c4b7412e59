#!/usr/bin/env bash
# Chromium and its WebDriver (Debian's chromium and chromium-driver, one version) for the job page's
# browser tests (tests/integration/test_job_page.py, driven by Selenium from the test extra).
# Numbered before 30-ssh.sh on purpose: installing Chromium's dependency tree once rewrote
# /etc/passwd here and dropped the system users that earlier installs had added (sshd, sgeadmin,
# munge, slurm); the steps that need those users check them (lib.sh's require_users).
# stdout: PSLAUNCH_CHROMIUM, PSLAUNCH_CHROMEDRIVER and SE_OFFLINE=true (Selenium Manager never
# looks for a driver on the network; the fixture names the driver itself).
source "$(dirname "$0")/lib.sh"
apt_install chromium chromium-driver
for bin in /usr/bin/chromium /usr/bin/chromedriver; do
    [ -x "$bin" ] || die "$bin is missing after installing chromium and chromium-driver"
done
browser=$(/usr/bin/chromium --version 2>/dev/null | grep -o '[0-9][0-9.]*' | head -n1)
driver=$(/usr/bin/chromedriver --version 2>/dev/null | grep -o '[0-9][0-9.]*' | head -n1)
[ "${browser%%.*}" = "${driver%%.*}" ] \
    || die "chromium $browser and chromedriver $driver differ in major version: apt-get install chromium chromium-driver"
log "chromium $browser, chromedriver $driver"
echo "export PSLAUNCH_CHROMIUM=/usr/bin/chromium"
echo "export PSLAUNCH_CHROMEDRIVER=/usr/bin/chromedriver"
echo "export SE_OFFLINE=true"
