#!/usr/bin/env bash
# Install, idempotently, the tools the suite checks deploy/ with:
#
#   prometheus, promtool   from Debian's `prometheus` package, unpacked (not
#                          installed) into .services/prometheus/, so no
#                          Prometheus service starts and nothing listens:
#                          .services/prometheus/usr/bin/{prometheus,promtool}
#   systemd-analyze        from Debian's `systemd` package, installed with apt
#                          when it is not on PATH
#
# A promtool and prometheus already on PATH are used as they are.
#
# Usage: scripts/deploy-tools.sh        (prints where each tool is)
# Env:   SERVICES_DIR (state dir, default <repo>/.services)
set -euo pipefail

# shellcheck source=scripts/services.sh
source "$(dirname "${BASH_SOURCE[0]}")/services.sh"

PROM_DIR=$STATE/prometheus
PROM_BIN=$PROM_DIR/usr/bin

# prometheus_tools: promtool and prometheus on PATH or in $PROM_BIN
prometheus_tools() {
	if command -v promtool >/dev/null && command -v prometheus >/dev/null; then
		RESULT[prometheus]="$(command -v prometheus), $(command -v promtool) (on PATH)"
		return 0
	fi
	if [[ -x $PROM_BIN/promtool && -x $PROM_BIN/prometheus ]]; then
		RESULT[prometheus]="$PROM_BIN/{prometheus,promtool}"
		return 0
	fi
	command -v apt-get >/dev/null || {
		fail prometheus "apt-get not found" "put promtool and prometheus on PATH"
		return 1
	}
	local sudo=()
	[[ $(id -u) == 0 ]] || sudo=(sudo -n)
	if apt_lists_empty; then
		"${sudo[@]}" apt-get -q -o DPkg::Lock::Timeout=600 update >&2 9>&- || true
	fi
	local tmp
	tmp=$(mktemp -d)
	chmod 755 "$tmp" # apt downloads as _apt
	log "downloading Debian's prometheus package (unpacked into $PROM_DIR, no service started)"
	if ! (cd "$tmp" && apt-get download -q prometheus >&2 9>&-); then
		"${sudo[@]}" apt-get -q -o DPkg::Lock::Timeout=600 update >&2 9>&- || true
		(cd "$tmp" && apt-get download -q prometheus >&2 9>&-) || {
			rm -rf "$tmp"
			fail prometheus "apt-get download prometheus failed" "check apt access: apt-get update && apt-get download prometheus"
			return 1
		}
	fi
	rm -rf "$PROM_DIR.new"
	mkdir -p "$PROM_DIR.new"
	dpkg-deb -x "$tmp"/prometheus_*.deb "$PROM_DIR.new"
	rm -rf "$tmp" "$PROM_DIR"
	mv "$PROM_DIR.new" "$PROM_DIR"
	"$PROM_BIN/promtool" --version >/dev/null 2>&1 || {
		fail prometheus "$PROM_BIN/promtool does not run" "ldd $PROM_BIN/promtool"
		return 1
	}
	RESULT[prometheus]="$PROM_BIN/{prometheus,promtool} (unpacked)"
}

systemd_analyze() {
	if ! command -v systemd-analyze >/dev/null; then
		apt_install systemd || {
			fail systemd "apt-get install systemd failed" "apt-get update && apt-get install -y systemd"
			return 1
		}
	fi
	RESULT[systemd]="$(command -v systemd-analyze)"
}

mkdir -p "$STATE"
[[ -e $STATE/.gitignore ]] || echo '*' >"$STATE/.gitignore"
exec 9>"$STATE/.tools.lock"
flock -w 900 9
prometheus_tools || true
systemd_analyze || true
for s in prometheus systemd; do
	printf 'deploy-tools: %-10s %s\n' "$s" "${RESULT[$s]:-?}"
done
((FAILED == 0))
