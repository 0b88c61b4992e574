#!/bin/sh
# The browser the dashboard's tests drive (Playwright over Debian's chromium): `make test` runs
# this first. Installs the `chromium` package when it is missing and we are root (CI runs as root
# on a fresh machine); otherwise says loudly how to get it. Never downloads a browser bundle.
set -eu

if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "halfmoon: WARNING: chromium is not installed and this is not root:" \
         "the dashboard's browser tests will fail. Install it: sudo apt-get install -y chromium" >&2
    exit 0
fi
echo "halfmoon: installing chromium (apt) for the dashboard's browser tests ..." >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null || echo "halfmoon: WARNING: apt-get update failed; trying the install anyway" >&2
apt-get install -y -q --no-install-recommends chromium >/dev/null
command -v chromium >/dev/null 2>&1 || { echo "halfmoon: ERROR: chromium did not install" >&2; exit 1; }
