#!/bin/bash
# The verbs shim's fast-path cost, in one Soft-RoCE guest run:
#  1. user-space instructions the shim adds per poll / post_recv / post_send+completion, counted
#     with callgrind on bench/fastpath.c at two loop sizes (N and 2N, so start-up cancels out);
#  2. bench/fastpath wall time per iteration, with and without the shim, alternating;
#  3. perftest message rate and latency with and without the shim, alternating rounds.
# Run it in the guest (not a test; it prints numbers, see docs/native-shim.md "Benchmark"):
#   cd tests && ../.venv/bin/python -m testbed.guest run --timeout 900 -- 'bash /work/main/bench/native_perf.sh'
# REPO (default: the checkout the script is in) is the tree whose shim and venv are used; SHIM
# (default: REPO's native/build/libibckpt.so) is the shim measured.
# Knobs: OUT (result dir, native/build/bench), ROUNDS (perftest rounds, 3), ITERS (perftest -n, 20000),
# QUICK=1 (tiny sizes), CALLGRIND=0 (skip part 1), ROUNDS=0 (callgrind only), PY.
set -u
REPO=${REPO:-$(cd "$(dirname "$0")/.." && pwd)}
OUT=${OUT:-$REPO/native/build/bench}
ROUNDS=${ROUNDS:-3}
ITERS=${ITERS:-20000}
# PY: the python that reads the results (a worktree has no .venv of its own).
PY=${PY:-$REPO/.venv/bin/python}
DEV=rxe0
GIDX=1
rm -rf "$OUT"
mkdir -p "$OUT"

# A private copy of the shim: others may rebuild native/build while this runs.
S=$OUT/libibckpt.so
cp "${SHIM:-$REPO/native/build/libibckpt.so}" "$S"
FP=$OUT/fastpath
gcc -std=c11 -O2 -g -Wall -Wextra -Werror -o "$FP" "$REPO/bench/fastpath.c" -libverbs || exit 1
echo "shim: $(sha256sum "$S" | cut -c1-16) from $(git -C $REPO rev-parse --short HEAD)$(git -C $REPO diff --quiet HEAD -- native/src || echo ' + uncommitted native/src changes')"
echo "kernel $(uname -r), $(nproc) vCPU, $(ib_send_bw --version 2>&1 | head -1)"

with() { # plain|shim cmd...: run cmd with the shim preloaded or not
	local cfg=$1; shift
	if [ "$cfg" = shim ]; then LD_PRELOAD=$S "$@"; else "$@"; fi
}

# ---- 1. callgrind ------------------------------------------------------------------------
if [ "${QUICK:-0}" = 1 ]; then
	SIZES="poll:2000 recv:200 write:50 send:50"
else
	SIZES="poll:20000 recv:2000 write:400 send:400"
fi
[ "${CALLGRIND:-1}" = 1 ] || SIZES=""
for ms in $SIZES; do
	mode=${ms%%:*} n=${ms#*:}
	for cfg in plain shim; do
		for k in $n $((2 * n)); do
			f=$OUT/cg-$mode-$cfg-$k
			with $cfg valgrind --tool=callgrind --callgrind-out-file="$f.out" \
				"$FP" -d $DEV -g $GIDX "$mode" "$k" >"$f.txt" 2>"$f.vg" ||
				{ echo "callgrind $mode $cfg $k failed:"; tail -5 "$f.vg"; }
		done
	done
done
if [ -n "$SIZES" ]; then
	echo
	echo "== 1. instructions the shim adds (callgrind, user space only)"
	$PY "$REPO/bench/fastpath_cost.py" callgrind "$OUT"
fi

# ---- 2. fastpath wall time -----------------------------------------------------------------
if [ "${QUICK:-0}" = 1 ]; then
	NATIVE="poll:20000 recv:2000 write:500"
else
	NATIVE="poll:1000000 recv:8000 write:20000 send:10000"
fi
: >"$OUT/perf.tsv"
for round in $(seq "$ROUNDS"); do
	if [ $((round % 2)) = 1 ]; then order="plain shim"; else order="shim plain"; fi
	for ms in $NATIVE; do
		mode=${ms%%:*} n=${ms#*:}
		for cfg in $order; do
			ns=$(with $cfg "$FP" -d $DEV -g $GIDX "$mode" "$n" | sed -n 's/.*ns_per_iter=//p')
			printf 'fastpath-%s\tns/iter\t%s\t%s\t%s\n' "$mode" $cfg "$round" "${ns:-nan}" >>"$OUT/perf.tsv"
		done
	done
done

# ---- 3. perftest, server and client both with or both without the shim ---------------------
port=18800
pair() { # log cfg prog args...
	local log=$1 cfg=$2; shift 2
	port=$((port + 1))
	with "$cfg" "$@" -p $port >"$log.srv" 2>&1 &
	local srv=$! i
	for i in $(seq 60); do # the server is slow to listen when the host is busy
		ss -ltn "sport = :$port" | grep -q LISTEN && break
		sleep 0.5
	done
	with "$cfg" timeout 120 "$@" -p $port 127.0.0.1 >"$log.cli" 2>&1
	local rc=$?
	sleep 0.5
	kill $srv 2>/dev/null
	wait $srv 2>/dev/null
	[ $rc = 0 ] || { echo "$* ($cfg) failed with $rc:"; tail -3 "$log.cli"; }
}
# --use_old_post_send: both variants post through ibv_post_send (perftest's default is the
# ibv_wr_* API, which the shim does not implement).
COMMON=(-d $DEV -x $GIDX -F --use_old_post_send -s 64)
for round in $(seq "$ROUNDS"); do
	# Alternate which configuration goes first, so drift in the host's load hits both alike.
	if [ $((round % 2)) = 1 ]; then order="plain shim"; else order="shim plain"; fi
	for cfg in $order; do
		l=$OUT/sendbw-$cfg-$round
		pair "$l" $cfg ib_send_bw "${COMMON[@]}" -n "$ITERS"
		awk -v c=$cfg -v r=$round '$1 == 64 && NF >= 5 {
			printf "ib_send_bw\tMpps\t%s\t%s\t%s\n", c, r, $5 }' "$l.cli" >>"$OUT/perf.tsv"
		l=$OUT/writebw-$cfg-$round
		pair "$l" $cfg ib_write_bw "${COMMON[@]}" -n "$ITERS"
		awk -v c=$cfg -v r=$round '$1 == 64 && NF >= 5 {
			printf "ib_write_bw\tMpps\t%s\t%s\t%s\n", c, r, $5 }' "$l.cli" >>"$OUT/perf.tsv"
		l=$OUT/sendlat-$cfg-$round
		pair "$l" $cfg ib_send_lat "${COMMON[@]}" -n $((ITERS / 4))
		awk -v c=$cfg -v r=$round '$1 == 64 && NF >= 6 {
			printf "ib_send_lat\tt_typical_us\t%s\t%s\t%s\n", c, r, $5
			printf "ib_send_lat\tt_avg_us\t%s\t%s\t%s\n", c, r, $6 }' "$l.cli" >>"$OUT/perf.tsv"
	done
done
echo
echo "== 2+3. side by side, $ROUNDS alternating rounds (values plain/shim per round)"
$PY "$REPO/bench/fastpath_cost.py" perftest "$OUT/perf.tsv"
