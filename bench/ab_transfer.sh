#!/usr/bin/env bash
# A benchmark of this tree and of another one in turn, ROUNDS times each (2), on one machine:
#   git archive <commit> -- kvstore_client kvstore_kernels kvstore bench examples tests/__init__.py \
#     tests/harness.py tests/pki.py | (mkdir -p BASE && tar -x -C BASE)
#   (a commit from before the layer folders: name client and kernels for kvstore_client and kvstore_kernels)
#   OUT=/tmp/ab bench/ab_transfer.sh BASE [--models mla --model-tokens 8192 32768]
#   BENCH=ttft ROUNDS=3 OUT=/tmp/ab bench/ab_transfer.sh BASE [--lengths 2048 8192 32768 --repeats 3 --parts reuse]
# Each tree runs its own bench/$BENCH.py (transfer or ttft) on its own kvstore, kvstore_client
# and kvstore_kernels (a tree from before the layer folders has them in client/ and kernels/:
# symlinked under /tmp/ab-names-* by their import names); the JSON results and logs go to $OUT.
# The summary: transfer's rows x memcpy per run; ttft's kvstore rows (the stored prefix's
# transfer and restore, ms) per run, and the median of each tree's runs.
set -u
base=$(cd "$1" && pwd); shift
bench=${BENCH:-transfer}; rounds=${ROUNDS:-2}
args=("$@")
if [ ${#args[@]} -eq 0 ]; then
  args=(--models mla --model-tokens 8192 32768)
  [ "$bench" = ttft ] && args=(--lengths 2048 8192 32768 --repeats 3 --parts reuse)
fi
out=${OUT:-/tmp/ab}; mkdir -p "$out"
names() {  # an older tree's client/ and kernels/ under their import names
  mkdir -p "/tmp/ab-names-$1"
  if [ -d "$2/client" ]; then ln -sfn "$2/client" "/tmp/ab-names-$1/kvstore_client"; fi
  if [ -d "$2/kernels" ]; then ln -sfn "$2/kernels" "/tmp/ab-names-$1/kvstore_kernels"; fi
}
here=$(pwd); names new "$here"; names base "$base"
for round in $(seq "$rounds"); do
  for tree in base new; do
    dir=$base; [ "$tree" = new ] && dir=$here
    (cd "$dir" && PYTHONPATH="$dir:/tmp/ab-names-$tree:${PYTHONPATH:-}" python3 "bench/$bench.py" "${args[@]}" \
      --name "ab-$bench-$tree$round" > "$out/$bench-$tree$round.txt" 2>&1; cp "bench/results/ab-$bench-$tree$round.json" "$out/")
  done
done
if [ "$bench" = transfer ]; then
  for round in $(seq "$rounds"); do
    for tree in base new; do echo "$tree$round"; grep "x memcpy" "$out/transfer-$tree$round.txt" | grep -v alone; done
  done
else
  python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
rows = {}
for tree in ("base", "new"):
    for r in range(1, rounds + 1):
        try:
            runs = json.load(open(f"{out}/ab-ttft-{tree}{r}.json"))["rows"]
        except (OSError, KeyError, ValueError) as exc:
            print(f"{tree}{r}: no results ({exc})")
            continue
        for row in runs:
            for key in ("transfer_ms", "restore_ms", "recompute_ms", "decode_step_ms"):
                rows.setdefault((row["tokens"], key), {}).setdefault(tree, []).append(row[key])
print(f"{'tokens':>7} {'row':15} {'base runs':>28} {'new runs':>28} {'new/base':>9}")
for (tokens, key), trees in sorted(rows.items()):
    base, new = trees.get("base", []), trees.get("new", [])
    ratio = statistics.median(new) / statistics.median(base) if base and new else float("nan")
    show = lambda xs: " ".join(f"{x:8.2f}" for x in xs)
    print(f"{tokens:7d} {key:15} {show(base):>28} {show(new):>28} {ratio:9.3f}")
PY
fi
