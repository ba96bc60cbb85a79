#!/usr/bin/env bash
# Stop the local test servers that scripts/services.sh started (mongo, rabbitmq,
# redis). Same arguments as `scripts/services.sh stop`:
#   scripts/services-stop.sh [--force] [redis|rabbitmq|mongo|all]...
# --force also stops servers on the local ports that services.sh did not start.
set -euo pipefail
exec "$(dirname "${BASH_SOURCE[0]}")/services.sh" stop "$@"
