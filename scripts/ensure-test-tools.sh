#!/usr/bin/env bash
# The live-view tests (tests/test_live_job.py) start Debian's `prometheus` server to scrape
# `ciuic-doctor export`, and drive `ciuic-doctor top` in `tmux` as a person would. Install both from the
# distribution's packages when they are missing and we may (root + apt); never download a build at run
# time. Without them those tests are skipped with that reason; everything else still runs.
# The Slurm tests start a two-node cluster (tests/slurm_cluster.py) from Debian's `slurm-wlm` and `munge`,
# installed the same way; their daemons live in /usr/sbin, which a non-root PATH may lack.
set -u
missing=""
command -v prometheus >/dev/null 2>&1 || missing="$missing prometheus"
command -v tmux >/dev/null 2>&1 || missing="$missing tmux"
{ command -v slurmctld || [ -x /usr/sbin/slurmctld ]; } >/dev/null 2>&1 || missing="$missing slurm-wlm"
{ command -v munged || [ -x /usr/sbin/munged ]; } >/dev/null 2>&1 || missing="$missing munge"
[ -z "$missing" ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing Debian's$missing for the live-view and Slurm tests..."
  # --no-install-recommends: the servers alone. Were their packaged services to start, no harm: the tests
  # start their own, on free loopback ports (Slurm: its own slurm.conf and munged socket in a temp folder)
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    $missing >/dev/null) || echo "could not install$missing; the tests that need them will be skipped"
fi
exit 0
