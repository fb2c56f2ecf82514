#!/usr/bin/env bash
# Flakiness check: `make test` ROUNDS x 2 times on one commit, two clean clones side by side, so each run has
# the other as its parallel CPU load (the condition a shared 2-core box puts the suite under).
#   usage: tests/flake_runs.sh [ROUNDS=5] [WORKDIR=a new temp dir]      (make test-flake)
# Each run appends one line to WORKDIR/results.txt: round, clone, rc, seconds, load average at start and end,
# files left dirty, pytest's summary line. Logs of every run stay in WORKDIR. Exit status: 0 if every run passed
# and left its clone clean.
set -u
rounds=${1:-5}
work=${2:-$(mktemp -d /tmp/pagedserve-flake.XXXXXX)}
src=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
commit=$(git -C "$src" rev-parse HEAD)
mkdir -p "$work"
cd "$work"
echo "flake runs of $commit: $rounds rounds x 2 clones in $work"
for c in A B; do
  [ -d $c ] || git clone -q "$src" $c
  git -C $c checkout -q "$commit"
  make -s -C $c .venv/.installed nginx promtool >install-$c.log 2>&1 || { echo "install failed in $c: $work/install-$c.log"; exit 2; }
done
for round in $(seq 1 "$rounds"); do
  for c in A B; do
    (
      cd $c
      start=$(date +%s)
      l0=$(cut -d' ' -f1 /proc/loadavg)
      make test >"../round$round-$c.log" 2>&1
      rc=$?
      echo "round=$round clone=$c rc=$rc secs=$(($(date +%s) - start)) load_start=$l0" \
        "load_end=$(cut -d' ' -f1 /proc/loadavg) dirty=$(git status --porcelain | wc -l)" \
        "summary=$(grep -E '(passed|failed|error)' "../round$round-$c.log" | tail -1)" >>../results.txt
    ) &
  done
  wait
  tail -2 results.txt
done
failed=$(grep -cv 'rc=0 .* dirty=0 ' results.txt)
echo "$((rounds * 2)) runs, $failed failed or dirty: $work/results.txt"
[ "$failed" -eq 0 ]
