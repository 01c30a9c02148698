#!/usr/bin/env bash
# GPU checks and benchmarks on the device machine (run from the repository root, no install needed):
# environment, the kernel GPU tests, then `flashwatch bench`. Logs go to $OUT (or /tmp/out).
#   bash benchmarks/gpu_session.sh [tests|newtests|alltests|compiletests|compileautotune|fallbacks|bench|ab|hopperab|sweep|statsweep|tune|overhead|hostcheck|equivalence|equivtest|compiled|compiledtwice|interleaved|plainsweep|partialsweep|
#                                   autotune|autotunekernels|monitoredkernels|monitorab|abtimes|chaintests|owncheck|statsab|kernelcheck|kernels|graphs|profile|ddp|host|chaincheck|ncu128|ncu64|hostprofile|monitoredhost|autotunehost|lab ...]   (default: tests bench)
# alltests: every test marked gpu but max-autotune's, in four logs (gpu_alltests, gpu_chain_tests, gpu_hopper_tests, gpu_compile);
# compiletests: the compiled training on CUDA alone (tests/test_compile_gpu.py, gpu_compile.log), but for
# max-autotune-no-cudagraphs (compileautotune, gpu_compile_autotune.log: Inductor's autotuning takes minutes);
# fallbacks: the GPU tests with the cached launch and the chain's in-kernel reduction off
# (FLASHWATCH_FAST_LAUNCH=0, FLASHWATCH_KERNEL_REDUCTION=0: the paths users can switch back to); autotune: the compiled arms under
# max-autotune-no-cudagraphs; kernels: one step's device time per kernel, SDPA against the own kernel
# newtests: every GPU test (kernels, compile, formats, chain, lifecycle, masks, coverage, the launch cache,
# the Hopper variants, the chain's in-kernel reduction); compiled: the
# Monitor's cost on GPT-2 small, eager and torch.compile'd (default mode); graphs: CUDA graphs
# (mode="reduce-overhead"): the GPU test that every monitored step is measured, then the compiled arms' timings;
# hostcheck: the sync tests, then the Monitor's cost eager and compiled (default mode), about 5 minutes;
# equivalence: does monitoring change training? observe mode's gradients against none (GPU test), then
# benchmarks/training_equivalence.py (about 5 minutes); equivtest: that GPU test alone (about a minute);
# profile: where an eager monitored step's extra device time goes (torch.profiler, observe mode), the
# chain's rows reduced in the kernels (the default), then stored
# statsweep: benchmarks/stats_sweep.py, the tiles of the observe-mode statistics kernel with the chain's rows
# hopperab: benchmarks/kernel_ab.py, the Hopper variants (fwd,dkdv / fwd,tma / dkdv,tma / fwd,dkdv,tma) and cuDNN
# ab: benchmarks/kernel_ab.py against kernels/_ab_before (a copy of an earlier revision's kernels/
# folder; or kernels/_ab_before.py, an earlier single-file kernels/triton_attn.py), then every
# kernels/_ab_before_* beside it; git-ignored, so pass them in the device tool's carry
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# flashwatch without installing it (this runs in a throwaway copy of the tree): link kernels/ in
# as flashwatch.kernels, the layout `pip install .` produces
[ -e flashwatch/kernels ] || ln -s ../kernels flashwatch/kernels
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
steps=${*:-tests bench}
gpu_tests() {  # NAME SECONDS PYTEST-ARGS...: the GPU tests, logged to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local paths=tests/; [[ "${1:-}" == tests/*.py ]] && paths=""
  timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE -o faulthandler_timeout=120 $paths "$@" \
    > "$OUT/$name.log" 2>&1
  local rc=$?
  [ $rc = 124 ] && echo "HUNG: $name stopped after $limit s; the stack of the test that ran is in $name.log" >> "$OUT/$name.log"
  tail -15 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
for step in $steps; do
  case $step in
    tests) timeout 420 python3 -m pytest -q -m gpu tests/test_triton_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    newtests) timeout 480 python3 -m pytest -q -p no:cacheprovider tests/test_triton_gpu.py tests/test_compile_gpu.py \
                tests/test_formats.py tests/test_chain.py tests/test_monitor_lifecycle.py tests/test_masks.py \
                tests/test_coverage.py tests/test_launch_cache.py tests/test_hopper_variants.py \
                tests/test_chain_kernel_reduction.py tests/test_resume_gpu.py 2>&1 | tee "$OUT/gpu_newtests.log" | tail -25 ;;
    # the default path's tests first, the opt-in Hopper variants apart: a hang in one (its stack is
    # dumped after 120 s, HUNG below) leaves the other's verdict standing
    # four pytest processes side by side (the tests are small; compiling kernels is CPU work): the
    # kernels, the chain and lifecycle, the opt-in Hopper variants, the compiled training (but for
    # max-autotune); a hang in one (its stack dumped after 120 s, HUNG below) leaves the others' verdicts
    alltests) gpu_tests gpu_alltests 540 tests/test_triton_gpu.py > "$OUT/.a1" &
              gpu_tests gpu_chain_tests 540 tests/test_chain.py tests/test_chain_kernel_reduction.py \
                tests/test_launch_cache.py tests/test_monitor_lifecycle.py tests/test_resume_gpu.py tests/test_sync_gpu.py tests/test_masks.py > "$OUT/.a2" &
              gpu_tests gpu_hopper_tests 540 tests/test_hopper_variants.py > "$OUT/.a3" &
              gpu_tests gpu_compile 540 tests/test_compile_gpu.py -k "not max-autotune" > "$OUT/.a4" &
              wait; for f in a1 a2 a3 a4; do tail -4 "$OUT/.$f"; rm -f "$OUT/.$f"; done ;;
    # the max-autotune cases apart and last: Inductor's autotuning of the backward took over 280 s for
    # one of them on the H200 (2026-12-03), so the others would not have run within one call
    compiletests) gpu_tests gpu_compile 400 tests/test_compile_gpu.py -k "not max-autotune" ;;
    compileautotune) gpu_tests gpu_compile_autotune 560 tests/test_compile_gpu.py -k "max-autotune" ;;
    fallbacks) FLASHWATCH_FAST_LAUNCH=0 FLASHWATCH_KERNEL_REDUCTION=0 gpu_tests gpu_fallbacks 540 \
                --ignore=tests/test_hopper_variants.py -k "not max-autotune" ;;
    # the first compilation on a machine autotunes every matrix product (more than 450 s for GPT-2 small on
    # 2026-12-03): call with AUTOTUNE_ARMS=sdpa first, then again with the default arms, which Inductor's cache on
    # the same machine serves
    autotune) A=${AUTOTUNE_ARMS:-sdpa,sdpa+observe,own_kernel,own_kernel+monitor}
              timeout 560 python3 benchmarks/monitor_overhead.py --only-compiled --compile max-autotune-no-cudagraphs \
                --arms "$A" --json "$OUT/monitor_overhead_autotune-${A//[,+]/_}.json" 2>&1 \
                | tee "$OUT/monitor_overhead_autotune-${A//[,+]/_}.log" | grep -v "Warning\|AUTOTUNE\|triton_mm\|^  " ;;
    # hostprofile: where the compiled own-kernel step's host time goes, against compiled SDPA's (CPU self time per
    # operator and runtime call, and per Python function, unmonitored steps), then the same eager
    hostprofile) timeout 280 python3 benchmarks/step_kernels.py --host --python --json "$OUT/step_host.json" 2>&1 | tee "$OUT/step_host.log" | grep -v Warning
                 timeout 200 python3 benchmarks/step_kernels.py --host --python --eager --json "$OUT/step_host_eager.json" 2>&1 \
                   | tee "$OUT/step_host_eager.log" | grep -v Warning ;;
    # monitoredhost: the host time a compiled monitored step adds, per operator and per Python function (observe
    # against SDPA, own kernel monitored against unmonitored); autotunehost: the own kernel's host time against SDPA's
    # under max-autotune-no-cudagraphs (its first compilation on a machine autotunes for minutes)
    monitoredhost) for arms in sdpa,observe_monitored own_kernel,own_kernel_monitored; do
                     timeout 280 python3 benchmarks/step_kernels.py --host --python --arms "$arms" \
                       --json "$OUT/step_host_${arms//,/_}.json" > "$OUT/step_host_${arms//,/_}.log" 2>&1
                     grep -v Warning "$OUT/step_host_${arms//,/_}.log" | tail -40
                   done ;;
    autotunehost) timeout 560 python3 benchmarks/step_kernels.py --host --python --compile-mode max-autotune-no-cudagraphs \
                    --json "$OUT/step_host_autotune.json" > "$OUT/step_host_autotune.log" 2>&1
                  grep -v "AUTOTUNE\|triton_mm\|^  \|Warning\|^E[0-9]\|^strides\|^dtypes\|Autotune Choices" \
                    "$OUT/step_host_autotune.log" | tail -40 ;;
    # autotunekernels: the same under max-autotune-no-cudagraphs (the first compilation autotunes every matrix product)
    autotunekernels) timeout 540 python3 benchmarks/step_kernels.py --compile-mode max-autotune-no-cudagraphs \
                       --json "$OUT/step_kernels_autotune.json" > "$OUT/step_kernels_autotune.log" 2>&1
                     grep -v "AUTOTUNE\|triton_mm\|^  \|Warning\|^E[0-9]\|^strides\|^dtypes\|Autotune Choices" \
                       "$OUT/step_kernels_autotune.log" | tail -40 ;;
    # monitoredkernels: what a compiled monitored step adds, kernel by kernel (observe against SDPA, then the
    # own kernel monitored against unmonitored; default compile mode)
    monitoredkernels) timeout 280 python3 benchmarks/step_kernels.py --arms sdpa,observe_monitored \
                        --json "$OUT/step_kernels_observe_monitored.json" 2>&1 | grep -v Warning \
                        | tee "$OUT/step_kernels_observe_monitored.log" | head -30
                      timeout 280 python3 benchmarks/step_kernels.py --arms own_kernel,own_kernel_monitored \
                        --json "$OUT/step_kernels_own_kernel_monitored.json" 2>&1 | grep -v Warning \
                        | tee "$OUT/step_kernels_own_kernel_monitored.log" | head -30 ;;
    kernels) timeout 300 python3 benchmarks/step_kernels.py --json "$OUT/step_kernels.json" 2>&1 | tee "$OUT/step_kernels.log"
             timeout 200 python3 benchmarks/step_kernels.py --eager --json "$OUT/step_kernels_eager.json" 2>&1 \
                | tee "$OUT/step_kernels_eager.log" ;;
    graphs) timeout 200 python3 -m pytest -q -s -p no:cacheprovider -rfE tests/test_compile_gpu.py -k reduce_overhead \
              > "$OUT/gpu_reduce_overhead.log" 2>&1; tail -4 "$OUT/gpu_reduce_overhead.log"
            timeout 380 python3 benchmarks/monitor_overhead.py --only-compiled --compile reduce-overhead \
              --json "$OUT/monitor_overhead_graphs.json" 2>&1 | tee "$OUT/monitor_overhead_graphs.log" | grep -v Warning ;;
    compiled) timeout 560 python3 benchmarks/monitor_overhead.py --compile default --json "$OUT/monitor_overhead_compiled.json" \
                2>&1 | tee "$OUT/monitor_overhead_compiled.log" | grep -v Warning ;;
    # compiledtwice: the compiled arms alone (default mode, 200 steps), SDPA timed again after the others, twice
    compiledtwice) for run in 1 2; do
            timeout 270 python3 benchmarks/monitor_overhead.py --only-compiled --compile default --steps 200 \
                --baseline-again --json "$OUT/monitor_overhead_compiled_run$run.json" 2>&1 \
                | tee "$OUT/monitor_overhead_compiled_run$run.log" | grep -v Warning
        done ;;
    # the four compiled arms side by side, 20 steps of each in turn (two monitored steps a turn): a device
    # that drifts during the run weighs on every arm alike
    interleaved) timeout 420 python3 benchmarks/monitor_overhead.py --only-compiled --compile default --steps 200 --stall-stacks 100 \
                --interleave 20 --json "$OUT/monitor_overhead_interleaved.json" 2>&1 \
                | tee "$OUT/monitor_overhead_interleaved.log" | grep -v Warning ;;
    bench) timeout 480 python3 -m flashwatch.cli bench --device-time --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" ;;
    ab) befores=$(for b in kernels/_ab_before kernels/_ab_before.py kernels/_ab_before_*; do [ -e "$b" ] && echo "--before $b"; done)
        timeout 400 python3 benchmarks/kernel_ab.py $befores --json "$OUT/kernel_ab.json" 2>&1 | tee "$OUT/kernel_ab.log" ;;
    # statsab: the observe-mode statistics pass (without and with the chain's rows) against kernels/_ab_before
    # monitorab: the Monitor's cost on a compiled step, the package against an earlier one: .ab_before/flashwatch
    # (git-ignored; made with `git archive REV flashwatch kernels | tar -x -C .ab_before` and kernels/ moved into
    # flashwatch/), in the order before, after, before, after, one process each (about 25 s an arm); then the
    # GPU tests of the W^Q-error chain (chaintests); abtimes: the timings alone (arms: AB_ARMS, default sdpa+observe)
    monitorab) bash "$0" abtimes chaintests | grep -v "^NVIDIA\|^torch" ;;
    abtimes) for which in before after before2 after2; do
                 case $which in before*) pp=$PWD/.ab_before:$PWD/benchmarks ;; *) pp=$PWD:$PWD/benchmarks ;; esac
                 PYTHONPATH=$pp timeout 250 python3 benchmarks/monitor_overhead.py --only-compiled --compile default \
                   --arms "${AB_ARMS:-sdpa+observe}" --steps 200 --json "$OUT/monitor_ab_$which.json" > "$OUT/monitor_ab_$which.log" 2>&1
                 echo "== $which"; grep -v Warning "$OUT/monitor_ab_$which.log" | grep -A9 "^arm"
               done ;;
    # owncheck: the own kernel's GPU tests, eager and compiled (but for max-autotune), side by side
    owncheck) gpu_tests gpu_kernel_tests 300 tests/test_triton_gpu.py > "$OUT/.o1" &
              gpu_tests gpu_compile 300 tests/test_compile_gpu.py -k "not max-autotune" > "$OUT/.o2" &
              wait; tail -n 4 "$OUT/.o1" "$OUT/.o2"; rm -f "$OUT/.o1" "$OUT/.o2" ;;
    chaintests) gpu_tests gpu_chain_tests 300 tests/test_chain.py tests/test_chain_kernel_reduction.py tests/test_chain_sums.py \
                  tests/test_chain_true_gradient.py ;;
    statsab) timeout 300 python3 benchmarks/stats_ab.py --before kernels/_ab_before --json "$OUT/stats_ab.json" 2>&1 \
               | grep -v Warning | tee "$OUT/stats_ab.log" ;;
    # the opt-in Hopper variants against the default kernels and cuDNN (what would make one a default)
    hopperab) timeout 500 python3 benchmarks/kernel_ab.py --variant plain --cudnn --hopper fwd,dkdv --hopper fwd,tma \
                --hopper dkdv,tma --hopper fwd,dkdv,tma --json "$OUT/hopper_ab.json" 2>&1 | tee "$OUT/hopper_ab.log" ;;
    sweep) timeout 400 python3 benchmarks/dq_stats_sweep.py --json "$OUT/dq_stats_sweep.json" 2>&1 | tee "$OUT/dq_stats_sweep.log" ;;
    # the plain kernels' configurations at D = 128 against cuDNN (benchmarks/plain_sweep.py), about 5 minutes
    plainsweep) timeout 330 python3 benchmarks/plain_sweep.py --json "$OUT/plain_sweep.json" 2>&1 | tee "$OUT/plain_sweep.log" ;;
    statsweep) timeout 300 python3 benchmarks/stats_sweep.py --json "$OUT/stats_sweep.json" 2>&1 | tee "$OUT/stats_sweep.log" ;;
    # partialsweep: benchmarks/partials_sweep.py, the tiles of the chain's add_partials at GPT-2 small's call
    partialsweep) timeout 200 python3 benchmarks/partials_sweep.py --json "$OUT/partials_sweep.json" 2>&1 \
                    | tee "$OUT/partials_sweep.log" ;;
    tune) timeout 500 python3 -m flashwatch.cli bench --tune --json "$OUT/bench_tuned.json" 2>&1 | tee "$OUT/bench_tuned.log" ;;
    # the monitored step's host work: no host synchronisation (the sync tests), then its cost eager and compiled
    hostcheck) gpu_tests gpu_sync 150 tests/test_sync_gpu.py tests/test_chain.py
               timeout 150 python3 benchmarks/monitor_overhead.py --json "$OUT/monitor_overhead.json" 2>&1 \
                 | tee "$OUT/monitor_overhead.log" | grep -v Warning
               timeout 240 python3 benchmarks/monitor_overhead.py --only-compiled --compile default \
                 --json "$OUT/monitor_overhead_compiled.json" 2>&1 | tee "$OUT/monitor_overhead_compiled.log" | grep -v Warning ;;
    # kernelcheck: after a change to the statistics kernels, in one call of about 9 minutes: their GPU tests (kernels,
    # the chain's in-kernel reduction), the statistics pass against kernels/_ab_before (statsab), then the Monitor's
    # cost compiled (default mode)
    # (the 69 tests took more than 220 s on 2026-12-05, while another test process compiled beside them)
    kernelcheck) gpu_tests gpu_kernel_tests 300 tests/test_triton_gpu.py tests/test_chain_kernel_reduction.py
                 timeout 100 python3 benchmarks/stats_ab.py --before kernels/_ab_before --json "$OUT/stats_ab.json" 2>&1 \
                   | grep -v Warning | tee "$OUT/stats_ab.log" | tail -24
                 timeout 170 python3 benchmarks/monitor_overhead.py --only-compiled --compile default \
                   --json "$OUT/monitor_overhead_compiled.json" 2>&1 | tee "$OUT/monitor_overhead_compiled.log" | grep -v Warning ;;
    # does monitoring change training? the same steps under SDPA, observe and own-kernel mode, eager and compiled
    equivtest) gpu_tests gpu_equivalence 150 tests/test_compile_gpu.py -k leaves_every_gradient ;;  # the GPU test alone (~1 min)
    equivalence) gpu_tests gpu_equivalence 150 tests/test_compile_gpu.py -k leaves_every_gradient
                 timeout 420 python3 benchmarks/training_equivalence.py --json "$OUT/training_equivalence.json" 2>&1 \
                   | tee "$OUT/training_equivalence.log" | grep -v Warning ;;
    overhead) timeout 300 python3 benchmarks/monitor_overhead.py --json "$OUT/monitor_overhead.json" 2>&1 | tee "$OUT/monitor_overhead.log" | grep -v Warning ;;
    ddp) timeout 200 python3 benchmarks/ddp_demo.py --json "$OUT/ddp_demo.json" 2>&1 | tee "$OUT/ddp_demo.log" | tail -45 ;;
    host) timeout 200 python3 benchmarks/host_overhead.py --json "$OUT/host_overhead.json" 2>&1 | tee "$OUT/host_overhead.log" ;;
    # the W^Q-error chain's kernels after a change: their per-row outputs' GPU tests (each failure's reason printed),
    # then the chain's device time per call and the Monitor's cost on GPT-2 small (about 6 minutes in all)
    chaincheck) gpu_tests gpu_chain_rows 240 tests/test_chain_kernel_reduction.py tests/test_triton_gpu.py -k "rows or reduc"
                timeout 120 python3 benchmarks/host_overhead.py --json "$OUT/host_overhead.json" > "$OUT/host_overhead.log" 2>&1
                grep -E "shape|plain|stats" "$OUT/host_overhead.log"
                timeout 200 python3 benchmarks/monitor_overhead.py --json "$OUT/monitor_overhead.json" 2>&1 \
                  | grep -v Warning | tee "$OUT/monitor_overhead.log" | tail -8 ;;
    # Nsight Compute on the three kernels of one plain forward+backward at D 128, where plain is 0.76-0.80x cuDNN
    ncu128) timeout 400 ncu --clock-control none --kernel-name regex:'_attn_(fwd|bwd_dq|bwd_dkdv)_kernel' --launch-skip 3 \
              --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
              --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --csv \
              --page details python3 benchmarks/profile_kernels.py --shape 4,32,4096,128 --variants plain \
              > "$OUT/ncu_d128.csv" 2> "$OUT/ncu_d128.log"; tail -5 "$OUT/ncu_d128.log"; wc -l "$OUT/ncu_d128.csv" ;;
    # Nsight Compute on the D 64 kernels of plain, statistics and fixed (one forward+backward each, after a compiling
    # pass), at GPT-2 small's call and at 8 x 16 x 2048 x 64, where plain is 0.88x cuDNN
    ncu64) for shape in 16,12,1024,64 8,16,2048,64; do
             timeout 150 ncu --clock-control none --kernel-name regex:'_attn_(fwd|bwd_dq|bwd_dkdv)_kernel' --launch-skip 9 \
               --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
               --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --csv \
               --page details python3 benchmarks/profile_kernels.py --shape $shape \
               > "$OUT/ncu_d64_${shape//,/x}.csv" 2> "$OUT/ncu_d64_${shape//,/x}.log"; wc -l "$OUT/ncu_d64_${shape//,/x}.csv"
           done ;;
    profile) timeout 200 python3 benchmarks/profile_monitored_step.py 2>&1 | tee "$OUT/profile_monitored_step.log" | tail -8
             FLASHWATCH_KERNEL_REDUCTION=0 timeout 200 python3 benchmarks/profile_monitored_step.py 2>&1 \
               | tee "$OUT/profile_monitored_step_store.log" | tail -8 ;;
    lab) timeout 200 python3 -m research.lab --device cuda --json "$OUT/lab.json" 2>&1 | tee "$OUT/lab.log" | tail -40 ;;
    *) echo "unknown step $step" ;;
  esac
done
