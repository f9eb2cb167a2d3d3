#!/usr/bin/env bash
# Run a learning-benchmark version's runs (every method x seed of one task) as separate processes, JOBS at once, each
# into its own results file in DIR: on a GPU, where one 135M team leaves most of the device idle. Then, in the
# checkout, merge them into the version's results file (which reports the tables and claims):
#     python recipes/benchmarks/bench_learning.py --version V --merge DIR/*.json
# Usage (any further arguments go to every bench_learning.py run, e.g. --registered COMMIT:BLOB outside a checkout):
#     bash recipes/benchmarks/bench_learning_parallel.sh VERSION TASK DIR JOBS "METHODS" "SEEDS" [ARGS...]
set -euo pipefail
version=$1 task=$2 dir=$3 jobs=$4 methods=$5 seeds=$6; shift 6
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$dir"; rm -f "$dir"/*.failed
for seed in $seeds; do
  for method in $methods; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
    name="$dir/$method-$seed"
    (OMP_NUM_THREADS=1 python3 "$here/bench_learning.py" --version "$version" --task "$task" --methods "$method" \
      --seeds "$seed" --results "$name.json" "$@" > "$name.log" 2>&1 \
      && echo "done: $method seed $seed" || { echo "FAILED: $method seed $seed (see $name.log)"; touch "$name.failed"; }) &
  done
done
wait
failed=$(find "$dir" -name '*.failed' | wc -l)
[ "$failed" -eq 0 ] || { echo "$failed run(s) failed"; exit 1; }
