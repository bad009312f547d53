#!/usr/bin/env bash
# The report test opens report.html in Debian's headless Chromium. Install it from the distribution's
# packages when it is missing and we may (root + apt); never download a browser build at run time.
# Without it the browser test is skipped with that reason, everything else still runs.
set -u
command -v chromium >/dev/null 2>&1 && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing Debian's chromium for the report test..."
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "could not install chromium; the browser test will be skipped"
fi
exit 0
