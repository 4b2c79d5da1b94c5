#!/usr/bin/env bash
# The model rows of this tree and of another one in turn, twice each, on one machine:
#   git archive <commit> -- kvstore_client kvstore_kernels kvstore bench tests/__init__.py tests/harness.py \
#     tests/pki.py | (mkdir -p BASE && tar -x -C BASE)
#   (a commit from before the layer folders: name client and kernels for kvstore_client and kvstore_kernels)
#   OUT=/tmp/ab bench/ab_transfer.sh BASE [--models mla --model-tokens 8192 32768]
# Each tree runs its own bench/transfer.py on its own kvstore, kvstore_client and kvstore_kernels
# (a tree from before the layer folders has them in client/ and kernels/: symlinked under
# /tmp/ab-names-* by their import names); the JSON results and logs go to $OUT.
set -u
base=$(cd "$1" && pwd); shift
args=("$@"); [ ${#args[@]} -eq 0 ] && args=(--models mla --model-tokens 8192 32768)
out=${OUT:-/tmp/ab}; mkdir -p "$out"
names() {  # an older tree's client/ and kernels/ under their import names
  mkdir -p "/tmp/ab-names-$1"
  if [ -d "$2/client" ]; then ln -sfn "$2/client" "/tmp/ab-names-$1/kvstore_client"; fi
  if [ -d "$2/kernels" ]; then ln -sfn "$2/kernels" "/tmp/ab-names-$1/kvstore_kernels"; fi
}
here=$(pwd); names new "$here"; names base "$base"
for round in 1 2; do
  for tree in base new; do
    dir=$base; [ "$tree" = new ] && dir=$here
    (cd "$dir" && PYTHONPATH="$dir:/tmp/ab-names-$tree:${PYTHONPATH:-}" python3 bench/transfer.py "${args[@]}" \
      --name "ab-$tree$round" > "$out/$tree$round.txt" 2>&1; cp "bench/results/ab-$tree$round.json" "$out/")
  done
done
for f in base1 new1 base2 new2; do echo "$f"; grep "x memcpy" "$out/$f.txt" | grep -v alone; done
