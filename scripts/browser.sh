#!/usr/bin/env bash
# Install the browser the console's tests drive, idempotently: Debian's
# `chromium` and `chromium-driver` (chromedriver), from the distribution's
# own packages, like the other servers of scripts/services.sh. Nothing is
# downloaded from anywhere else; a chromedriver already on PATH is used.
#
# Usage: scripts/browser.sh           install if missing, then print versions
# Env:   CHROMEDRIVER (a chromedriver to use instead, e.g. a local build)
# Exit status: 0 chromium and chromedriver are usable, 1 otherwise.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

log() { printf 'browser: %s\n' "$*" >&2; }

have() {
	command -v "${CHROMEDRIVER:-chromedriver}" >/dev/null &&
		{ command -v chromium >/dev/null || command -v chromium-browser >/dev/null; }
}

apt_lists_empty() { ! compgen -G '/var/lib/apt/lists/*_Packages*' >/dev/null; }

install() {
	command -v apt-get >/dev/null || {
		log "ERROR: apt-get not found; install chromium and chromedriver by hand"
		return 1
	}
	local sudo=()
	[[ $(id -u) == 0 ]] || sudo=(sudo -n)
	local opts=(-y -q --no-install-recommends -o DPkg::Lock::Timeout=600)
	log "installing chromium chromium-driver (apt)"
	if apt_lists_empty; then
		"${sudo[@]}" apt-get -q -o DPkg::Lock::Timeout=600 update >&2
	fi
	if ! "${sudo[@]}" apt-get install "${opts[@]}" chromium chromium-driver fonts-dejavu-core >&2; then
		log "apt-get install failed; retrying after apt-get update"
		"${sudo[@]}" apt-get -q -o DPkg::Lock::Timeout=600 update >&2
		"${sudo[@]}" apt-get install "${opts[@]}" chromium chromium-driver fonts-dejavu-core >&2
	fi
}

if ! have; then
	install || {
		log "ERROR: could not install chromium and chromium-driver; see the apt output above"
		exit 1
	}
fi
have || {
	log "ERROR: chromium or chromedriver still missing after the install"
	exit 1
}
printf 'browser: %s, %s\n' "$(chromium --version 2>/dev/null | head -1)" \
	"$("${CHROMEDRIVER:-chromedriver}" --version 2>/dev/null | head -1)"
