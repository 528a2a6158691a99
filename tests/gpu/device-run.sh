#!/bin/bash
# The issue-4 GPU checks in one device call (about 4-5 minutes on the H200 host),
# from the repository root, after `make gpu-carry` here and with carry
# [".carry/staging-gpu.test.xz", ".carry/ncclengine.test.xz", ".carry/e2e.test.xz",
#  ".carry/rlflow.xz", ".carry/temporal.xz"]:
#   1. benchmarks from one run (TestGPUBench: staging sweep against the pinned
#      ceiling, end to end against torch, raw broadcast against torch.distributed);
#   2. correctness (byte-exact W2/W3 packed and non-packed, F32->BF16, a peer
#      that never joins, a killed receiver);
#   3. the NCCL engine (transfer/ncclengine) through the transfer activities against vLLM-like HTTP receivers
#      of API generations D and E (E: the unique id in init_info.nccl_unique_id_b64);
#   4. what vLLM's receiver can take (issue 17): fp8 (float8_e4m3fn as NCCL
#      type 10) non-packed byte-exact, a packed checkpoint with a 0-dim tensor
#      refused before anything is sent, and torch's own view rules against
#      the planner's packed check (gpu-issue17.log);
#   5. the GPU worker SIGKILLed mid-broadcast on a real dev server.
# Logs go to $OUT (gpu-*.log, gpu-logs.tgz with figures.json).
# Knobs: ONLY_BENCH=1 stops after 1; BENCH (the -test.run of 1); STAGE (the
# sweep's RLFLOW_STAGE_CONFIGS); PASSES (RLFLOW_STAGE_PASSES, default 5);
# RAW_ROUNDS (RLFLOW_RAW_ROUNDS, default 3); QUIET_WAIT (seconds, default 0);
# T_BENCH, T_CORR, T_TRANSFER, T_I17, T_REC (seconds).
set -o pipefail
for b in staging-gpu.test ncclengine.test e2e.test rlflow temporal; do
	xz -dc .carry/$b.xz > /tmp/$b && chmod +x /tmp/$b || exit 2
done
# Both sides on the receiver's NCCL: ranks of different NCCL versions refuse
# to connect ("Mismatched NCCL version").
L=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2
export RLFLOW_NCCL_LIB=$L RECEIVER_NCCL_LIB=$L RLFLOW_GPU_LOGS=$PWD/gpu-logs
# The default, two neighbours, the default with 12 workers and with
# prefaulting, the previous default (2 MiB slots, one worker each) and the
# 128 MiB ring, in PASSES interleaved passes (each pass also measures both
# ceilings: the pinned H2D copy and the CPU's host copy).
export RLFLOW_STAGE_CONFIGS=${STAGE:-'^(default|ring-w8M-64M-parts1M|ring-w4M-48M-parts1M|default-12workers|default-prefault2|ring-w2M-64M|ring-w4M-128M)$'}
export RLFLOW_STAGE_PASSES=${PASSES:-5}
# Go and torch alternate in the raw broadcast benchmark, RAW_ROUNDS times.
export RLFLOW_RAW_ROUNDS=${RAW_ROUNDS:-3}
mkdir -p "$RLFLOW_GPU_LOGS"
R=$PWD
rc=0
step() { # name, status
	echo "$1 rc=$2"
	[ "$2" = 0 ] || rc=1
}

# Which host this is: the staging figures depend on the CPU and its cache.
{
	lscpu | grep -E '^(Model name|Model:|CPU\(s\)|L3|NUMA node\(s\))'
	echo "L3 per cpu0: $(cat /sys/devices/system/cpu/cpu0/cache/index3/size 2>/dev/null)"
	nvidia-smi --query-gpu=name,pci.bus_id,driver_version --format=csv,noheader
	# How loaded the machine is as the run starts: the load average, and
	# /proc/stat's aggregate CPU line one second apart (its 8th number is
	# steal, vCPU time given to other guests).
	echo "loadavg: $(cat /proc/loadavg)"
	head -1 /proc/stat; sleep 1; head -1 /proc/stat
	# Where the bench checkpoints live and whether their page cache can be
	# huge pages: what faulting a fresh mapping in costs depends on both.
	echo "kernel: $(uname -r)"
	echo "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null); shmem: $(cat /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>/dev/null)"
	df -T "${TMPDIR:-/tmp}" /dev/shm 2>/dev/null | sed 's/^/fs: /'
} | tee "$OUT/host.txt"

# QUIET_WAIT=S: before the benchmarks, wait up to S seconds for a quiet
# spell: one spinning loop per CPU for 4 s, during which /proc/stat must show
# under 2% steal (vCPU time the hypervisor gave other guests; it only shows
# while our vCPUs want to run, hence the spinning). Every sample goes to
# host.txt; the run starts anyway when S is spent. The staging figure
# depends on the host's CPUs, which the pinned ceiling does not see.
waited=0
while [ "${QUIET_WAIT:-0}" -gt 0 ]; do
	spin=()
	for _ in $(seq "$(nproc)"); do sh -c 'while :; do :; done' & spin+=($!); done
	sleep 0.5; a=$(head -1 /proc/stat); sleep 4; b=$(head -1 /proc/stat)
	kill "${spin[@]}"; wait "${spin[@]}" 2>/dev/null
	q=$(printf '%s\n%s\n' "$a" "$b" | awk '{for(i=2;i<=9;i++)v[NR,i]=$i}
		END{t=0; for(i=2;i<=9;i++){d[i]=v[2,i]-v[1,i]; t+=d[i]}; if(t==0)t=1; st=d[9]/t*100;
		printf "%s: steal %.1f%% with every CPU spinning", st<2?"quiet":"loaded", st}')
	echo "after ${waited}s: $q" | tee -a "$OUT/host.txt"
	case $q in quiet*) break ;; esac
	waited=$((waited + 20))
	[ "$waited" -ge "$QUIET_WAIT" ] && { echo "no quiet spell in ${QUIET_WAIT}s: running anyway" | tee -a "$OUT/host.txt"; break; }
	sleep 15
done

cd "$R/nccl/staging" || exit 2
timeout "${T_BENCH:-300}" /tmp/staging-gpu.test -test.v -test.timeout 10m -test.run "${BENCH:-TestGPUBench}" > "$OUT/gpu-bench.log" 2>&1
step bench $?
grep -E "GPU-FIGURE stage .*(MEDIAN|BEST|DEFAULT|ceiling)|^--- " "$OUT/gpu-bench.log" | cut -c1-260
grep "GPU-FIGURE" "$OUT/gpu-bench.log" | grep -v "GPU-FIGURE stage" | cut -c1-260
if [ -z "$ONLY_BENCH" ]; then
	timeout "${T_CORR:-120}" /tmp/staging-gpu.test -test.v -test.timeout 10m -test.run 'TestGPUPeerNeverJoins|TestGPUBroadcastToReceivers|TestGPUKilledReceiver' > "$OUT/gpu-correctness.log" 2>&1
	step correctness $?
	grep -E "^(---|    ---)" "$OUT/gpu-correctness.log"

	cd "$R/transfer/ncclengine" || exit 2
	timeout "${T_TRANSFER:-240}" /tmp/ncclengine.test -test.v -test.timeout 10m -test.run '^(TestGPUTransferToHTTPReceivers|TestGPUTransferGenE)$' > "$OUT/gpu-transfer.log" 2>&1
	step transfer $?
	grep -E "^(---|    ---)" "$OUT/gpu-transfer.log"

	timeout "${T_I17:-120}" /tmp/ncclengine.test -test.v -test.timeout 10m -test.run '^(TestGPUFP8NonPacked|TestGPUPackedZeroDimRefused|TestTorchUnpackRuleMatchesPlan)$' > "$OUT/gpu-issue17.log" 2>&1
	step issue17 $?
	grep -E "^GPU-(PASS|FAIL)|^(---|    ---)" "$OUT/gpu-issue17.log" | cut -c1-400

	cd "$R/e2e" || exit 2
	RLFLOW_TEMPORAL=/tmp/temporal RLFLOW_BIN=/tmp/rlflow timeout "${T_REC:-90}" /tmp/e2e.test -test.v -test.timeout 10m -test.run 'TestGPUHostWorkerSIGKILLDuringBroadcast$' > "$OUT/gpu-recovery.log" 2>&1
	step recovery $?
	grep -E "^(---|    ---)" "$OUT/gpu-recovery.log"
fi
tar czf "$OUT/gpu-logs.tgz" -C "$RLFLOW_GPU_LOGS" .
exit $rc
