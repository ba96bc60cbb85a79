#!/usr/bin/env bash
# Prints the demo's database name for a key file: codepool_demo_ and 12 hex
# digits of a hash of the file's HMAC key. The demo's data and its key file
# belong together: another checkout (another key file) gets a database of
# its own instead of one whose codes its key cannot decrypt, and `keys add`
# or `keys rotate` (which keep the HMAC key) keep the name.
set -euo pipefail
KEY_FILE=${1:?usage: demo-db.sh KEY_FILE}
hmac=$(sed -n 's/.*"hmac"[[:space:]]*:[[:space:]]*"\([0-9a-fA-F]*\)".*/\1/p' "$KEY_FILE" | head -n 1)
if [ -z "$hmac" ]; then
  echo "demo-db.sh: $KEY_FILE has no hmac key; is it a codepool key file?" >&2
  exit 1
fi
tag=$(printf 'codepool-demo:%s' "$hmac" | sha256sum | cut -c1-12)
echo "codepool_demo_$tag"
