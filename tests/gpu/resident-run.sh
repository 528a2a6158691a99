#!/bin/bash
# The issue-18 GPU checks (the resident trainer) in one device call, from the
# repository root after `make gpu-carry` here, with carry [".carry"] (it uses
# .carry/ncclengine.test.xz only). About 8-9 minutes with every step:
#   py        trainer/python/test_rlflow_trainer.py: the trainer helper's tests
#             (CUDA IPC publish read back by another process, deterministic
#             save/load round trip on the GPU, serve() over real pipes);
#   example   tests/gpu/resident_trainer_gpu.py: the example trainer
#             (pipelines/examples/resident) killed, restarted, replayed:
#             byte-identical to an undisturbed run;
#   snapshot  TestGPUSnapshotBroadcast: the engine broadcasts a torch process's
#             CUDA IPC snapshot zero-copy to receiver.py D and E servers;
#   sigkill   TestGPUResidentSIGKILL: trainer.Manager + bench_trainer.py killed
#             twice in iteration 5 of 6; restarts, replay, receiver SHA-256s
#             after every iteration identical to an undisturbed run;
#   e2e, ipc  (only when named in ONLY) TestGPUResidentPipelineSIGKILL and
#             TestGPUResidentPipelineIPC from .carry/e2e.test.xz and
#             temporal.xz: the SIGKILL, and vLLM's ipc backend against the
#             nccl path, as pipelines on a Temporal dev server;
#   bench     TestGPUResidentBench: issue 18's figure, (a) bench_seed.py vs
#             (b) the checkpoint path vs (c) the resident path, 1 GiB and
#             4 GiB, non-packed and packed 1 GiB; as many rounds (up to
#             ROUNDS) as fit in what is left of TOTAL.
# Logs go to $OUT (resident-<step>.log, gpu-logs.tgz with every process's log
# and resident-bench.json); the summary is printed last.
# Knobs: ONLY (step names, e.g. ONLY=bench: the benchmark alone, 3 rounds
# fit), TOTAL (seconds for everything, default 530: the benchmark gets what
# the steps before it left, at least 120), ROUNDS (RLFLOW_RESIDENT_ROUNDS,
# default 3), SIZES (RLFLOW_RESIDENT_SIZES, default 4GiB,1GiB), PACKED
# (RLFLOW_RESIDENT_PACKED, default false,true), BENCH_BUDGET
# (RLFLOW_RESIDENT_BUDGET_S, default T_BENCH-40), T_PY, T_EXAMPLE, T_SNAP,
# T_KILL, T_BENCH (seconds per step).
# Each step runs under timeout(1), which signals its whole process group
# (the receivers and bench_seed.py with it; trainers die with their Manager
# by Pdeathsig), so a step cut short leaves nothing on the GPU.
set -o pipefail
set +m # background jobs stay in this group: timeout(1) makes its own
R=$PWD
case " ${ONLY:-py example snapshot sigkill bench} " in *" snapshot "*|*" sigkill "*|*" bench "*)
	xz -dc .carry/ncclengine.test.xz > /tmp/ncclengine.test && chmod +x /tmp/ncclengine.test || exit 2 ;;
esac
PY=/opt/torch/.venv/bin/python3
[ -x "$PY" ] || PY=$(command -v python3)
# Both NCCL sides on the receiver's library (ranks of different builds refuse
# each other); bench_seed.py and receiver.py read RECEIVER_NCCL_LIB.
L=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2
export RLFLOW_PYTHON=$PY RLFLOW_NCCL_LIB=$L RECEIVER_NCCL_LIB=$L RLFLOW_GPU_LOGS=$R/gpu-logs
export RLFLOW_GPU_DIR=${RLFLOW_GPU_DIR:-/tmp/rlflow-gpu} CUBLAS_WORKSPACE_CONFIG=:4096:8
# 4 GiB first: when the time runs out, the 1 GiB rounds are the ones lost.
export RLFLOW_RESIDENT_ROUNDS=${ROUNDS:-3} RLFLOW_RESIDENT_SIZES=${SIZES:-4GiB,1GiB} RLFLOW_RESIDENT_PACKED=${PACKED:-false,true}
STEPS=${ONLY:-py example snapshot sigkill bench}
# The benchmark gets what is left of TOTAL seconds (at least 120) unless
# T_BENCH says otherwise; its budget stops starting rounds 40 s before that.
TOTAL=${TOTAL:-530}
mkdir -p "$RLFLOW_GPU_LOGS" "$RLFLOW_GPU_DIR"
{
	nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv,noheader
	echo "python: $PY ($($PY -c 'import torch; print("torch", torch.__version__)' 2>&1 | tail -1))"
	echo "loadavg: $(cat /proc/loadavg)"
	df -T "$RLFLOW_GPU_DIR" "${TMPDIR:-/tmp}" | sed 's/^/fs: /'
	echo "steps: $STEPS; rounds $RLFLOW_RESIDENT_ROUNDS, sizes $RLFLOW_RESIDENT_SIZES, packed $RLFLOW_RESIDENT_PACKED; ${TOTAL}s in all"
} 2>&1 | tee "$OUT/host.txt"

rc=0
SUMMARY=()
# step NAME SECONDS DIR CMD...: runs CMD in DIR, logs to $OUT/resident-NAME.log.
step() {
	local name=$1 secs=$2 dir=$3 t0=$SECONDS s
	shift 3
	case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
	echo "== $name (timeout ${secs}s)"
	(cd "$dir" && timeout -k 10 "$secs" "$@") > "$OUT/resident-$name.log" 2>&1
	s=$?
	[ "$s" = 0 ] || rc=1
	[ "$s" = 124 ] && echo "$name: TIMED OUT after ${secs}s; its last lines:" && tail -5 "$OUT/resident-$name.log" | cut -c1-300
	SUMMARY+=("$name rc=$s in $((SECONDS - t0))s: $(grep -c '^GPU-PASS' "$OUT/resident-$name.log") GPU-PASS, $(grep -c '^GPU-FAIL' "$OUT/resident-$name.log") GPU-FAIL")
	grep -E "^(GPU-FAIL|--- |    --- |RESULT|Ran |OK|FAILED|SKIP)" "$OUT/resident-$name.log" | cut -c1-400
}

GT=/tmp/ncclengine.test
step py "${T_PY:-80}" "$R" "$PY" trainer/python/test_rlflow_trainer.py -v
step example "${T_EXAMPLE:-80}" "$R" "$PY" tests/gpu/resident_trainer_gpu.py
step snapshot "${T_SNAP:-90}" "$R/transfer/ncclengine" $GT -test.v -test.timeout 20m -test.run '^TestGPUSnapshotBroadcast$'
step sigkill "${T_KILL:-100}" "$R/transfer/ncclengine" $GT -test.v -test.timeout 20m -test.run '^TestGPUResidentSIGKILL$'
step e2e "${T_E2E:-280}" "$R/e2e" sh -c 'xz -dc ../.carry/e2e.test.xz > /tmp/e2e.test && xz -dc ../.carry/temporal.xz > /tmp/temporal && chmod +x /tmp/e2e.test /tmp/temporal && RLFLOW_TEMPORAL=/tmp/temporal exec /tmp/e2e.test -test.v -test.timeout 10m -test.run "^TestGPUResidentPipelineSIGKILL\$"' # ONLY=e2e: TestGPUResidentPipelineSIGKILL, the SIGKILL as a pipeline on a Temporal dev server (needs .carry/e2e.test.xz, temporal.xz)
step ipc "${T_IPC:-200}" "$R/e2e" sh -c '[ -x /tmp/e2e.test ] || { xz -dc ../.carry/e2e.test.xz > /tmp/e2e.test && xz -dc ../.carry/temporal.xz > /tmp/temporal && chmod +x /tmp/e2e.test /tmp/temporal; } && RLFLOW_TEMPORAL=/tmp/temporal exec /tmp/e2e.test -test.v -test.timeout 10m -test.run "^TestGPUResidentPipelineIPC\$"' # ONLY=ipc: TestGPUResidentPipelineIPC, vLLM's ipc backend (receiver.py --backend ipc) against the nccl path on a Temporal dev server (same carry as e2e)
T_BENCH=${T_BENCH:-$((TOTAL - SECONDS > 120 ? TOTAL - SECONDS : 120))}
export RLFLOW_RESIDENT_BUDGET_S=${BENCH_BUDGET:-$((T_BENCH - 40))}
case " $STEPS " in *" bench "*) echo "bench: ${T_BENCH}s, rounds start within ${RLFLOW_RESIDENT_BUDGET_S}s" ;; esac
# The receivers answer update_weights once the bytes arrived and hash them
# when asked (GET /received), so the hashing is in none of the timings.
export RECEIVER_LAZY_DIGEST=1
step bench "$T_BENCH" "$R/transfer/ncclengine" $GT -test.v -test.timeout 20m -test.run '^TestGPUResidentBench$'

tar czf "$OUT/gpu-logs.tgz" -C "$RLFLOW_GPU_LOGS" . 2>/dev/null
echo "== summary"
printf '%s\n' "${SUMMARY[@]}"
grep -h "^GPU-FIGURE snapshot" "$OUT"/resident-snapshot.log 2>/dev/null | cut -c1-300
grep -h "^GPU-FIGURE resident round=" "$OUT"/resident-bench.log 2>/dev/null | cut -c1-420
grep -h -E "^GPU-FIGURE resident (size=|:)" "$OUT"/resident-bench.log 2>/dev/null | cut -c1-500
exit $rc
