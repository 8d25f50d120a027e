#!/usr/bin/env bash
# The vLLM GPU runs on the H200 (device tool), after the offline vLLM bundle's parts have been
# stashed there (docs/results.md, "How the suite ran on the H200"; ../shared/tools/vllm_gpu). From the project root:
#
#   bash tests/vllm/h200.sh start [pytest args]   # unpack + install, then the GPU e2e suite in
#                                                 # the background (FUSEMLA_VLLM_GPU_ONLY passes)
#   bash tests/vllm/h200.sh wait N    # wait up to N s for it; copy log + JSON report to $OUT
#   bash tests/vllm/h200.sh bench     # benchmarks/bench_vllm.py (TPOT on vs off), JSON to $OUT
#   bash tests/vllm/h200.sh depth NAME [pair args] [+ latency args ...]   # the full-depth
#                                     # benchmark's jobs one after the other, in the background,
#                                     # from their own copy of the checkout; DEPTH_END_IN=S: every
#                                     # pair ends within S s from now (what the lease has left)
#   bash tests/vllm/h200.sh then-depth NAME [args]  # after start: that depth job once the suite is done
#                                     # (DEPTH_END_IN counts from this call, not from its start)
#   bash tests/vllm/h200.sh depth-wait N [NAME]   # wait up to N s for job NAME; its JSON + logs to $OUT
#   bash tests/vllm/h200.sh kernels [paths]   # the kernel + layer suite (--device=cuda, the
#                                     # machine's own torch; all of tests/ or the paths given), in
#                                     # the background from a copy of the checkout
#   bash tests/vllm/h200.sh kernels-wait N   # wait up to N s for it; its log to $OUT
#   bash tests/vllm/h200.sh kbench NAME MODULE [args]   # a kernel benchmark (python3 -m MODULE
#                                     # args --out ...) on the machine's own torch, in the
#                                     # background from its own copy of the checkout
#   bash tests/vllm/h200.sh kbench-get [N] [NAME]   # wait up to N s (default 0) for it; the JSON
#                                     # and log it wrote so far to $OUT: fetch in every call of
#                                     # a lease, so a machine lost mid-lease keeps what it measured
#   bash tests/vllm/h200.sh vtests PATHS   # tests that need the bundle's vLLM but no engine
#                                     # (tests/vllm/test_epilogue_vllm_quant.py), in the foreground;
#                                     # their log to $OUT
#   bash tests/vllm/h200.sh warm-save   # the caches a lease's first engine fills, to $OUT
#   bash tests/vllm/h200.sh warm-load   # restore them from $VG/warm/ (carried), before `depth`
#
# Parts: a call carries at most 64 MiB with the checkout (~20 MB of tracked files on 2026-12-08,
# growing with the committed results): build the bundle with PART_SIZE=40M (19 parts for vLLM
# 0.33), not the builder's default 60M (45M parts no longer fit beside the checkout).
#
# Warm caches (docs/method.md): `depth-wait` saves them once its jobs are done
# (warm_<commit>.txz.NN in $OUT); copy the parts into $VG/warm/ here and carry them in one call
# of the next lease, whose command runs `warm-load`.
#
# VGPU=<folder> (default .vgpu) picks the bundle (e.g. .vgpu033 for vLLM 0.33, whose gpu_env.sh
# unpacks elsewhere, so two bundles live side by side on one machine) and VTAG (default vllm032)
# names the outputs: h200_<VTAG>_gpu_tests_<commit>.log and so on.
# The suite runs detached (setsid) so it outlives one device call; its files live in
# /tmp/vgpu_run_<VTAG>.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
VG=${VGPU:-.vgpu}
VTAG=${VTAG:-vllm032}
RUN=/tmp/vgpu_run_$VTAG
OUTDIR=${OUT:-/tmp/out}
mkdir -p "$RUN" "$OUTDIR"
# the commit under test: $VG/commit (written here before the call, carried), kept for later calls
[[ -f $VG/commit ]] && cp "$VG/commit" "$RUN/commit"
# gpu_env.sh likewise: every call lays the working tree anew, so a later call that did not carry
# it (a second `depth` in the same lease) takes the copy the first one kept on the machine
if [[ -f $VG/gpu_env.sh ]]; then cp "$VG/gpu_env.sh" "$RUN/gpu_env.sh"
elif [[ -f $RUN/gpu_env.sh ]]; then mkdir -p "$VG" && cp "$RUN/gpu_env.sh" "$VG/gpu_env.sh"; fi
commit=$(cat "$RUN/commit" 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)

copy_checkout() {  # the checkout (no bundle, no lease scratch) into folder $1: a job's own copy
  tar --exclude="./.vgpu*" --exclude="./.lease" -cf - . | tar -xf - -C "$1"
}

case ${1:-} in
  start)
    bash $VG/gpu_env.sh setup || exit 1
    nvidia-smi -L
    rm -f "$RUN"/done "$RUN"/tests.log
    extra=""  # more pytest arguments (e.g. -k ...); none: printf would make an empty argument,
    (( $# > 1 )) && extra=$(printf ' %q' "${@:2}")  # which pytest reads as "." (every test)
    setsid nohup bash -c "
      export FUSEMLA_VLLM_GPU_REPORT=$RUN/report.json
      bash $VG/gpu_env.sh run -- python3 -m pytest -q -rs --device=cuda -p no:cacheprovider \
        tests/vllm/test_vllm_gpu.py $extra > $RUN/tests.log 2>&1
      echo \$? > $RUN/done" > /dev/null 2>&1 < /dev/null &
    echo "[h200] GPU e2e suite started at commit $commit" ;;
  wait)
    limit=${2:-500}
    t0=$SECONDS
    while [[ ! -f $RUN/done ]] && (( SECONDS - t0 < limit )); do sleep 5; done
    tail -c 6000 "$RUN"/tests.log
    [[ -f $RUN/done ]] && echo "[h200] suite exit status $(cat $RUN/done)" || echo "[h200] still running"
    cp "$RUN"/tests.log "$OUTDIR/h200_${VTAG}_gpu_tests_$commit.log" 2>/dev/null
    cp "$RUN"/report.json "$OUTDIR/h200_${VTAG}_gpu_report_$commit.json" 2>/dev/null
    ls /tmp/pytest-of-*/ 2>/dev/null | tail -1 ;;
  bench)
    bash $VG/gpu_env.sh run -- python3 benchmarks/bench_vllm.py \
      --out "$OUTDIR/h200_${VTAG}_bench_$commit.json" "${@:2}" 2>&1 | tee "$OUTDIR/h200_${VTAG}_bench_$commit.log" ;;
  depth)
    # the working tree is laid anew by every device call: the job runs from a copy under /tmp
    name=${2:?depth NAME ...}
    # a kernel benchmark still running (kbench) would share the GPU with the engines: stopped
    for g in /tmp/kbench_out/pgid_*; do  # no file: the glob stays as written
      [[ -f $g && ! -f /tmp/kbench_out/done_${g##*/pgid_} ]] || continue
      kill -- -"$(cat "$g")" 2>/dev/null || continue
      echo "stopped by depth" > /tmp/kbench_out/done_${g##*/pgid_}
      echo "[h200] kernel benchmark ${g##*/pgid_} still running: stopped (kbench-get returns what it saved)"
    done
    bash $VG/gpu_env.sh setup || exit 1
    rm -rf /tmp/depth_src && mkdir -p /tmp/depth_src /tmp/depth_out
    copy_checkout /tmp/depth_src
    cp -r $VG /tmp/depth_src/ && echo "$commit" > /tmp/depth_out/commit
    rm -f /tmp/depth_out/done_$name
    # jobs run one after the other, separated by a lone "+": "pair ARGS" or "latency ARGS"
    # (vllm_depth.py's subcommands; one that starts with an option is a pair), or
    # "benchmarks/SCRIPT.py ARGS" or "-m MODULE ARGS" (given --out-dir /tmp/depth_out/NAME_N)
    job=/tmp/depth_out/job_$name.sh
    echo "cd /tmp/depth_src" > $job
    # DEPTH_END_IN=S: every pair of the job ends within S seconds from now (--end-at), each
    # with what the jobs before it left: say how much of the lease is left when starting it
    # (DEPTH_END_AT=EPOCH: the same as an absolute time; then-depth sets it when queued)
    end_at=""
    [[ -n ${DEPTH_END_IN:-} ]] && end_at=" --end-at $(( $(date +%s) + DEPTH_END_IN ))"
    [[ -n ${DEPTH_END_AT:-} ]] && end_at=" --end-at $DEPTH_END_AT"
    line="" n=0
    for a in "${@:3}" +; do
      if [[ $a == + ]]; then
        [[ ($line == " -"* && $line != " -m "*) || -z $line ]] && line=" pair$line"
        if [[ $line == " benchmarks/"*.py* || $line == " -m "* ]]; then
          # another script, or a module (-m benchmarks.bench_epilogue ...): its own output folder
          echo "bash $VG/gpu_env.sh run -- python3$line --out-dir /tmp/depth_out/${name}_$n" >> $job
        else
          [[ $line == " pair "* ]] && line+=$end_at
          echo "bash $VG/gpu_env.sh run -- python3 benchmarks/vllm_depth.py$line --out-dir /tmp/depth_out --tag ${name}_$n --cache-root /tmp/depth_cache" >> $job
        fi
        line="" n=$((n + 1))
      else
        line+=$(printf ' %q' "$a")
      fi
    done
    cat $job
    # GPU clocks, power and throttle reasons beside the run (a TPOT that moves with them is the GPU's)
    setsid nohup nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active,utilization.gpu \
      --format=csv -lms 250 > /tmp/depth_out/smi_$name.csv 2>&1 < /dev/null &
    setsid nohup bash -c "bash $job > /tmp/depth_out/driver_$name.log 2>&1
      echo \$? > /tmp/depth_out/done_$name" > /dev/null 2>&1 < /dev/null &
    echo "[h200] depth job $name started at commit $commit" ;;
  then-depth)
    # after `start`: the depth job NAME [args] begins as soon as the suite is done, with no
    # device call in between (both would not fit the GPU at once)
    name=${2:?then-depth NAME ...}
    args=$(printf ' %q' "${@:2}")
    # DEPTH_END_IN counts from now (the queueing call), not from when the suite is done
    end=""
    [[ -n ${DEPTH_END_IN:-} ]] && end="DEPTH_END_AT=$(( $(date +%s) + DEPTH_END_IN )) "
    # (and after the kernel suite, where one was started: it shares the GPU)
    setsid nohup bash -c "while [ ! -f $RUN/done ] || { [ -d /tmp/kern_run ] && [ ! -f /tmp/kern_run/done ]; }; do sleep 2; done
      cd $(printf '%q' "$PWD") && ${end}DEPTH_END_IN= VGPU=$VG VTAG=$VTAG bash tests/vllm/h200.sh depth$args \
        > /tmp/depth_start_$name.log 2>&1" > /dev/null 2>&1 < /dev/null &
    echo "[h200] depth job $name queued behind the suite" ;;
  depth-wait)
    limit=${2:-500}
    t0=$SECONDS
    name=${3:-*}
    while ! ls /tmp/depth_out/done_$name >/dev/null 2>&1 && (( SECONDS - t0 < limit )); do sleep 5; done
    for f in /tmp/depth_out/driver_$name.log; do echo "== $f"; tail -c 4000 "$f"; done
    ls -la /tmp/depth_out
    tar -C /tmp/depth_out -czf "$OUTDIR/depth_$commit.tgz" --exclude=vllm_cache --exclude='model_*' --exclude='./*/model' . 2>/dev/null
    nvidia-smi --query-gpu=memory.used --format=csv,noheader
    # once every job is done, the caches its engines filled come back too (warm-save)
    pending=0
    for j in /tmp/depth_out/job_*.sh; do  # no job file: the glob stays as written, pending
      n=${j##*/job_}; [[ -f /tmp/depth_out/done_${n%.sh} ]] || pending=1
    done
    if (( pending )); then echo "[h200] jobs still running: warm caches not saved yet"
    else bash "$0" warm-save; fi ;;
  warm-save)
    # FlashInfer's JIT modules, vLLM's torch.compile artifacts and Triton's kernels, if present,
    # in at most 3 parts of 15 MiB: the results beside them in $OUT must still come back (a
    # call returns 8 files, 64 MiB in all), so Triton's go first, then everything
    paths=()
    for p in "$HOME/.cache/flashinfer" /tmp/depth_cache/torch_compile_cache "$HOME/.triton/cache"; do
      [[ -d $p ]] && paths+=("$p")
    done
    rm -f "$OUTDIR"/warm_*.txz.* /tmp/warm.txz
    while (( ${#paths[@]} )); do
      tar -cPf - "${paths[@]}" 2>/dev/null | xz -T0 -6 > /tmp/warm.txz
      (( $(stat -c %s /tmp/warm.txz) <= 45 * 1024 * 1024 )) && break
      echo "[h200] warm caches over 45 MiB with ${paths[-1]}: left out"
      unset 'paths[-1]'
      rm -f /tmp/warm.txz
    done
    [[ -f /tmp/warm.txz ]] || { echo "[h200] no warm caches to save"; exit 0; }
    split -b 15M -d -a 2 /tmp/warm.txz "$OUTDIR/warm_$commit.txz."
    echo "[h200] warm caches saved: ${paths[*]} -> $(du -h /tmp/warm.txz | cut -f1) in $(ls "$OUTDIR"/warm_*.txz.* | wc -l) parts" ;;
  warm-load)
    ls "$VG"/warm/warm_*.txz.* > /dev/null 2>&1 || { echo "[h200] no warm caches carried"; exit 0; }
    cat "$VG"/warm/warm_*.txz.* | xz -dc | tar -xPf - && echo "[h200] warm caches restored: $(ls "$VG"/warm)" ;;
  vtests)
    (( $# > 1 )) || { echo "vtests PATHS"; exit 2; }
    bash $VG/gpu_env.sh run -- python3 -m pytest -q -rs --device=cuda -p no:cacheprovider "${@:2}" \
      > "$OUTDIR/h200_${VTAG}_vtests_$commit.log" 2>&1
    status=$?
    tail -n 15 "$OUTDIR/h200_${VTAG}_vtests_$commit.log"
    echo "[h200] vtests exit status $status"
    exit $status ;;
  kernels)
    rm -rf /tmp/kern_src /tmp/kern_run && mkdir -p /tmp/kern_src /tmp/kern_run
    copy_checkout /tmp/kern_src
    echo "$commit" > /tmp/kern_run/commit
    paths=" tests"  # or the test paths given after `kernels`
    (( $# > 1 )) && paths=$(printf ' %q' "${@:2}")
    setsid nohup bash -c "cd /tmp/kern_src && FUSEMLA_COMMIT=$commit python3 -m pytest -q -rs \
      --device=cuda -p no:cacheprovider --ignore=tests/ops/test_prologue_properties.py \
      --ignore=tests/vllm --ignore=tests/ops/test_targets.py$paths > /tmp/kern_run/tests.log 2>&1
      echo \$? > /tmp/kern_run/done" > /dev/null 2>&1 < /dev/null &
    echo "[h200] kernel suite started at commit $commit" ;;
  kernels-wait)
    limit=${2:-500}
    t0=$SECONDS
    while [[ ! -f /tmp/kern_run/done ]] && (( SECONDS - t0 < limit )); do sleep 5; done
    tail -c 3000 /tmp/kern_run/tests.log
    [[ -f /tmp/kern_run/done ]] && echo "[h200] kernel suite exit status $(cat /tmp/kern_run/done)" || echo "[h200] kernel suite still running"
    cp /tmp/kern_run/tests.log "$OUTDIR/h200_gpu_tests_$commit.log" 2>/dev/null ;;
  kbench)
    # 2026-12-04: an epilogue sweep ran in the background while the bundle's parts arrived; its
    # first rows were printed, then the machine stopped answering and took the JSON with it
    name=${2:?kbench NAME MODULE [args]}
    mod=${3:?kbench NAME MODULE [args]}
    src=/tmp/kbench_src_$name
    rm -rf "$src" /tmp/kbench_out/"$name"_* /tmp/kbench_out/{done,pgid}_"$name"
    mkdir -p "$src" /tmp/kbench_out
    copy_checkout "$src"
    args=""  # printf with no arguments would make one empty argument
    (( $# > 3 )) && args=$(printf ' %q' "${@:4}")
    base=/tmp/kbench_out/${name}_$commit
    setsid nohup bash -c "echo \$\$ > /tmp/kbench_out/pgid_$name; cd $src && python3 -m $mod$args --out $base.json > $base.log 2>&1
      echo exit status \$? > /tmp/kbench_out/done_$name" > /dev/null 2>&1 < /dev/null &
    echo "[h200] kernel benchmark $name ($mod) started at commit $commit" ;;
  kbench-get)
    limit=${2:-0}
    name=${3:-*}
    t0=$SECONDS
    while ! ls /tmp/kbench_out/done_$name >/dev/null 2>&1 && (( SECONDS - t0 < limit )); do sleep 5; done
    for f in /tmp/kbench_out/${name}_*.log; do
      [[ -f $f ]] || { echo "[h200] no kernel benchmark $name"; exit 1; }
      n=${f##*/}; n=${n%_*}
      if [[ -f /tmp/kbench_out/done_$n ]]; then echo "== $f (ended: $(cat /tmp/kbench_out/done_$n))"
      else echo "== $f (still running)"; fi
      tail -n 6 "$f"
      cp "$f" "${f%.log}.json" "$OUTDIR"/ 2>/dev/null
    done ;;
  *) echo "usage: $0 start | wait [seconds] | bench [bench_vllm.py args] | depth NAME [args] | then-depth NAME [args] | depth-wait [seconds] | kernels | kernels-wait [seconds] | kbench NAME MODULE [args] | kbench-get [seconds] [NAME] | vtests PATHS | warm-save | warm-load"; exit 2 ;;
esac
