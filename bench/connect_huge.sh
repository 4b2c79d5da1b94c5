#!/usr/bin/env bash
# Issue #31 part 1 on the GPU machine: a worker fills the arena from connect on, with the arena on
# hugetlbfs (2 MiB pages), on a tmpfs mounted huge=always (THP) and on /dev/shm (4 KiB pages), at
# 64 GiB and, where the host's memory allows, 100 GiB (bench/connect.py --parts fill --pages).
# As root, in the repository root, with PYTHONPATH set up:
#     bench/connect_huge.sh [NAME]     # bench/results/NAME.json (default connect-fill-huge)
# The hugetlbfs rows come first, on one pool set aside for the largest size (given back after);
# then THP and 4 KiB pages, size by size. Rows not expected to end within BUDGET_S of the start
# are skipped, and the bench is stopped at BUDGET_S + 40 s whatever it is doing. A kind of page
# that cannot be set up is skipped with its reason. The JSON, and this output, go to $OUT if set.
# Settings (environment): SIZES ("64 100"), BUDGET_S (420), TOKENS (8192), PAUSE (10),
# HEADROOM_GIB (20: memory left to the workers beside the largest arena), KINDS ("hugetlbfs thp
# small": the kinds of page, in that order), MODES ("bounce": each row with the client's bounce
# ring; "bounce wait": also without it, stores waiting for their slabs).
set -u
NAME=${1:-connect-fill-huge}
SIZES=${SIZES:-64 100}
BUDGET_S=${BUDGET_S:-420}
TOKENS=${TOKENS:-8192}
PAUSE=${PAUSE:-10}
HEADROOM_GIB=${HEADROOM_GIB:-20}
KINDS=${KINDS:-hugetlbfs thp small}
MODES=${MODES:-bounce}
wants() { case " $KINDS " in *" $1 "*) return 0 ;; esac; return 1; }
THP_DIR=/mnt/kvstore-thp
HUGE_DIR=/mnt/kvstore-hugetlbfs
RESULT=bench/results/$NAME.json
START=$(date +%s)
UNTIL=$((START + BUDGET_S))
KILL_AT=$((UNTIL + 40))
POOL_BEFORE=$(cat /proc/sys/vm/nr_hugepages)

LOG=/dev/null
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT" && LOG=$OUT/$NAME.log
fi
exec > >(tee -a "$LOG") 2>&1

say() { printf '[%3ds] %s\n' $(($(date +%s) - START)) "$*"; }
meminfo() { awk -v k="$1:" '$1 == k {print $2}' /proc/meminfo; }
unmount() {  # lazily where a process still maps an arena there
  if mountpoint -q "$1"; then umount "$1" 2>/dev/null || umount -l "$1"; fi
  rmdir "$1" 2>/dev/null
}
cleanup() {
  unmount "$THP_DIR"
  unmount "$HUGE_DIR"
  echo "$POOL_BEFORE" >/proc/sys/vm/nr_hugepages 2>/dev/null
}
trap cleanup EXIT
trap 'exit 143' TERM INT

# The bench with the rows it may still start; stopped (its process group: workers and daemons
# too) at KILL_AT. Each row is in $RESULT as soon as it is done.
bench() {
  local left=$((KILL_AT - $(date +%s)))
  if [ "$left" -le 30 ]; then
    say "skipped --pages $*: the time is spent"
    return
  fi
  timeout -k 15 "$left" python3 bench/connect.py --parts fill --sizes $FITS --tokens "$TOKENS" \
    --pause "$PAUSE" --thp-dir "$THP_DIR" --hugetlbfs-dir "$HUGE_DIR" --name "$NAME" --append \
    --until "$UNTIL" --label "$NAME" --modes $MODES --pages "$@"
  local code=$?
  if [ "$code" -ne 0 ]; then
    say "bench/connect.py --pages $* ended with $code (124/137: stopped at the time limit)"
    sleep 6  # a daemon stopped with it drains for up to 5 s, then unlinks its arena
  fi
}

say "connect_huge: $NAME; sizes $SIZES GiB; $TOKENS-token prompts; pause $PAUSE s; budget $BUDGET_S s"
say "host: $(nproc) cores, $(($(meminfo MemTotal) >> 20)) GiB, kernel $(uname -r), tree $(git rev-parse --short HEAD 2>/dev/null)"
command -v nvidia-smi >/dev/null && say "GPU: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)"
say "shmem THP: $(cat /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>/dev/null || echo none)"
say "/dev/shm: $(df -h --output=size,avail /dev/shm | tail -1 | xargs) (size, free)"
if [ "$(id -u)" -ne 0 ]; then
  say "not root: no mounts, no huge page pool; 4 KiB pages only"
fi

MEM_GIB=$(($(meminfo MemTotal) >> 20))
FITS=""
for size in $SIZES; do
  if [ $((size + HEADROOM_GIB)) -le "$MEM_GIB" ]; then
    FITS="$FITS $size"
  else
    say "$size GiB: skipped, $MEM_GIB GiB of memory leaves less than $HEADROOM_GIB GiB beside it"
  fi
done
LARGEST=$(echo $FITS | tr ' ' '\n' | sort -n | tail -1)
if [ -z "$LARGEST" ]; then
  say "no size fits this host"
  exit 1
fi
rm -f "$RESULT"

# hugetlbfs: a pool for the largest arena plus a GiB (bench/connect.py keeps a GiB free), then
# the mount. Pages set aside late may not all be found: the rows that fit what was got run.
if ! wants hugetlbfs; then
  say "hugetlbfs: not asked for (KINDS)"
elif [ "$(id -u)" -eq 0 ] && grep -qw hugetlbfs /proc/filesystems; then
  want=$(((LARGEST + 1) * 512 + 64))
  say "hugetlbfs: setting aside $want pages of 2 MiB"
  echo "$want" >/proc/sys/vm/nr_hugepages
  got=$(cat /proc/sys/vm/nr_hugepages)
  if [ "$got" -lt "$want" ]; then
    say "hugetlbfs: got $got pages; dropping caches and compacting, then again"
    sync
    echo 3 >/proc/sys/vm/drop_caches
    echo 1 >/proc/sys/vm/compact_memory
    echo "$want" >/proc/sys/vm/nr_hugepages
    got=$(cat /proc/sys/vm/nr_hugepages)
  fi
  say "hugetlbfs: $got of $want pages ($((got >> 9)) GiB), $(meminfo HugePages_Free) free; $(($(meminfo MemAvailable) >> 20)) GiB available beside"
  mkdir -p "$HUGE_DIR"
  if [ "$got" -eq 0 ]; then
    say "hugetlbfs: skipped, the kernel set aside no pages"
  elif mount -t hugetlbfs -o pagesize=2M,mode=1777 none "$HUGE_DIR"; then
    bench hugetlbfs
  else
    say "hugetlbfs: skipped, the mount failed"
  fi
  unmount "$HUGE_DIR"
  echo 0 >/proc/sys/vm/nr_hugepages
  say "hugetlbfs: pool given back ($(cat /proc/sys/vm/nr_hugepages) pages; $(($(meminfo MemAvailable) >> 20)) GiB available)"
else
  say "hugetlbfs: skipped, $([ "$(id -u)" -eq 0 ] && echo 'not in /proc/filesystems' || echo 'not root')"
fi

# THP: a tmpfs of its own mounted huge=always (the daemon's fallocate gets 2 MiB pages there).
PAGES=""
wants small && PAGES="small"
if [ "$(id -u)" -eq 0 ] && wants thp; then
  mkdir -p "$THP_DIR"
  if ! mount -t tmpfs -o "size=$((LARGEST + 2))G,huge=always,mode=1777" tmpfs "$THP_DIR"; then
    say "thp: skipped, the mount failed"
  elif ! grep -q " $THP_DIR tmpfs .*huge=always" /proc/mounts; then
    say "thp: skipped, the mount does not say huge=always: $(grep " $THP_DIR " /proc/mounts)"
  else
    say "thp: $THP_DIR mounted ($(grep " $THP_DIR " /proc/mounts | cut -d' ' -f4))"
    PAGES="thp $PAGES"
  fi
fi
if [ -n "$PAGES" ]; then bench $PAGES; fi
unmount "$THP_DIR"

if [ -f "$RESULT" ]; then
  say "results: $RESULT"
  if [ -n "${OUT:-}" ]; then cp "$RESULT" "$OUT/" && say "copied to $OUT/$NAME.json"; fi
else
  say "no row was measured"
fi
say "done"
