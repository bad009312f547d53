#!/usr/bin/env bash
# The live-view tests (tests/test_live_job.py) start Debian's `prometheus` server to scrape
# `ciuic-doctor export`, and drive `ciuic-doctor top` in `tmux` as a person would. Install both from the
# distribution's packages when they are missing and we may (root + apt); never download a build at run
# time. Without them those tests are skipped with that reason; everything else still runs.
set -u
missing=""
command -v prometheus >/dev/null 2>&1 || missing="$missing prometheus"
command -v tmux >/dev/null 2>&1 || missing="$missing tmux"
[ -z "$missing" ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing Debian's$missing for the live-view tests..."
  # --no-install-recommends: the server alone. Were its packaged service to start, no harm: the test
  # starts its own server on a free loopback port
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    $missing >/dev/null) || echo "could not install$missing; the live-view tests that need them will be skipped"
fi
exit 0
