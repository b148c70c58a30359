#!/bin/bash
# Side-by-side perftest message rate and latency with and without libibckpt, and the
# user-space instructions the shim adds per post and per poll (callgrind).  Run it in the
# Soft-RoCE guest:
#   cd tests && ../.venv/bin/python -m testbed.guest run --timeout 900 -- 'bash /work/main/bench/native_perf.sh'
# Not a test: it prints numbers.
set -u
S=/work/main/native/build/libibckpt.so
T=/work/main/native/build/tests
OUT=${OUT:-/tmp/native-bench}
ITERS=${ITERS:-3000}
mkdir -p "$OUT"
port=18800

pair() { # name preload prog args...
	local name=$1 pre=$2; shift 2
	port=$((port + 1))
	env ${pre:+LD_PRELOAD=$pre} "$@" -p $port >"$OUT/$name.srv" 2>&1 &
	sleep 1
	env ${pre:+LD_PRELOAD=$pre} "$@" -p $port 127.0.0.1 >"$OUT/$name.cli" 2>&1
	wait
}

for round in 1 2; do
	for mode in plain shim; do
		pre=""; [ $mode = shim ] && pre=$S
		pair "bw-$mode-$round" "$pre" ib_send_bw -d rxe0 -x 1 -F -n $ITERS -s 64
		pair "lat-$mode-$round" "$pre" ib_send_lat -d rxe0 -x 1 -F -n $ITERS -s 64
		printf '%-6s round %d  send_bw 64B: %s\n' $mode $round \
			"$(awk '/^ *64 /{print "BW avg " $4 " MB/s, " $5 " Mpps"}' "$OUT/bw-$mode-$round.cli")"
		printf '%-6s round %d  send_lat 64B: %s\n' $mode $round \
			"$(awk '/^ *64 /{print "t_typical " $5 " us, t_avg " $6 " us"}' "$OUT/lat-$mode-$round.cli")"
	done
done

# Instructions per call: callgrind's inclusive cost of the app-visible post/poll entry
# divided by its call count, with and without the shim, on the same program.
cg() { # name preload
	local name=$1 pre=$2 stop=$OUT/stop-$1
	rm -f "$stop"
	port=$((port + 1))
	env ${pre:+LD_PRELOAD=$pre} $T/rc_seq -f "$stop" -p $port >"$OUT/$name.srv" 2>&1 &
	sleep 0.5
	env ${pre:+LD_PRELOAD=$pre} valgrind --tool=callgrind --callgrind-out-file="$OUT/$name.cg" \
		$T/rc_seq -f "$stop" -p $port -c 127.0.0.1 >"$OUT/$name.cli" 2>"$OUT/$name.vg" &
	sleep 20
	touch "$stop"
	wait
}
cg cg-plain ""
cg cg-shim "$S"
for f in "$OUT"/cg-plain.cg "$OUT"/cg-shim.cg; do
	echo "== $(basename "$f")"
	callgrind_annotate --inclusive=yes "$f" 2>/dev/null |
		grep -E 'ibk_post_send|ibk_poll_cq|rxe_post_send|rxe_poll_cq|post_send|poll_cq' | head -8
done
echo "calls: see 'calls=' lines with: callgrind_annotate --tree=caller"
