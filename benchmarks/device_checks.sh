#!/usr/bin/env bash
# The GPU checks, as one script for one short session on a machine with one CUDA GPU: the GPU
# kernels' test, `dhelix run --check` under NCCL, the interpreter against torch autograd, and
# `dhelix profile` then simulated against measured step times. Outputs go to $OUT (default
# out/device), each step's kept when a later one fails. Needs dhelix importable by $PY (default
# python3): `pip install -e .`, or PYTHONPATH pointing at an install of it and of lark,
# interegular and graphviz (then set PYTHONSAFEPATH=1 so that the checkout's dhelix/ folder does
# not shadow it). ONLY=013 runs steps 0, 1 and 3; BIG= another one-rank program. Steps 4-6 run one
# rank of a bigger world alone (`dhelix run --as-rank`): communication hiding with emulated links,
# and the peak memory of a paper example's rank 0. Results: benchmarks/results/h200_*, gpu_*.
set -u
OUT=${OUT:-out/device}
BIG=${BIG:-benchmarks/one_gpu_llama.dhx}  # the one-device model of steps 2 and 3
ONLY=${ONLY:-01234567}  # the steps to run (7 runs before 6)
PAIR=${PAIR:-benchmarks/llama70b_tp8_pair.dhx}  # steps 4, 6, 7: rank 0 of Llama-70B layers at TP-8
MEM=${MEM:-examples/llama8b_a40.dhx}  # step 5: a paper example whose rank 0 fits the GPU
LINKS5=${LINKS5:-none}  # step 5: memory does not depend on the links' speed
ROUNDS_AS_RANK=${ROUNDS_AS_RANK:-2}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
step() { echo "== $*" | tee -a "$OUT/steps.log"; }
{
  nvidia-smi -L 2>/dev/null; $PY -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")'
} | tee "$OUT/machine.txt"

[[ $ONLY == *0* ]] && step "0. the GPU kernels against the CPU kernels in float64"
[[ $ONLY == *0* ]] && $PY -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py 2>&1 | tee "$OUT/gpu_kernels.txt" | tail -15

[[ $ONLY == *1* ]] && step "1. dhelix run --check on one GPU (nccl, fp32): every step against the single-process reference"
[[ $ONLY == *1* ]] && $PY -m dhelix run benchmarks/one_gpu_tiny.dhx --steps 3 --check 2>&1 | tee "$OUT/check_one_gpu.txt"

[[ $ONLY == *2* ]] && step "2. the interpreter against torch autograd on one device (4 Llama-8B-sized layers, bf16)"
[[ $ONLY == *2* ]] && $PY benchmarks/one_device.py --program $BIG --rounds ${ROUNDS:-5} 2>&1 | tee "$OUT/one_device.txt"

[[ $ONLY == *3* ]] && step "3. dhelix profile, then simulated against measured step time (SI on and off)"
[[ $ONLY == *3* ]] && $PY benchmarks/predict_vs_run.py --program $BIG --rounds ${PREDICT_ROUNDS:-2} \
  --steps ${STEPS:-5} --repeats 5 --output "$OUT/predict_vs_run.txt" --keep-profile "$OUT/profile.yaml" 2>&1 | tail -20
[[ $ONLY == *3* ]] && $PY -m dhelix simulate $BIG --profile "$OUT/profile.yaml" 2>&1 | tee "$OUT/simulate.txt" | tail -15

[[ $ONLY == *4* ]] && step "4. rank 0 of Llama-70B layers at TP-8 alone, links emulated by copy: SI planned, op_by_op, off; torch.profiler"
[[ $ONLY == *4* ]] && timeout ${T4:-300} $PY benchmarks/as_rank_overlap.py --program $PAIR --emulate copy --steps 21 \
  --rounds $ROUNDS_AS_RANK --traces "$OUT/traces" --output "$OUT/as_rank_copy.txt" 2>&1 | tail -30

[[ $ONLY == *5* ]] && step "5. rank 0 of $MEM alone: measured peak memory beside the simulator's"
[[ $ONLY == *5* ]] && timeout ${T5:-240} $PY -m dhelix run $MEM --as-rank 0 --steps ${STEPS5:-2} \
  --emulate-links $LINKS5 --force --metrics "$OUT/mem_rank0.json" 2>&1 | tee "$OUT/mem_rank0.txt" | tail -20

[[ $ONLY == *7* ]] && step "7. dhelix profile --as-rank 0 of the TP-8 pair (links slept at the h100 profile's times), then run with that profile"
[[ $ONLY == *7* ]] && timeout ${T7:-240} $PY -m dhelix profile $PAIR --as-rank 0 --emulate-links sleep --repeats 3 \
  -o "$OUT/pair_profile.yaml" 2>&1 | tee "$OUT/pair_profile.txt" | tail -12
[[ $ONLY == *7* ]] && timeout ${T7:-240} $PY -m dhelix run $PAIR --as-rank 0 --emulate-links sleep --steps 21 \
  --profile "$OUT/pair_profile.yaml" --force --metrics "$OUT/pair_with_profile.json" 2>&1 | tee "$OUT/pair_with_profile.txt" | tail -14

[[ $ONLY == *6* ]] && step "6. as step 4, links emulated by sleep (the profile's predicted times)"
[[ $ONLY == *6* ]] && timeout ${T6:-200} $PY benchmarks/as_rank_overlap.py --program $PAIR --emulate sleep --steps 21 \
  --rounds $ROUNDS_AS_RANK --traces "$OUT/traces" --profile-variants "SI planned" "SI off" \
  --output "$OUT/as_rank_sleep.txt" 2>&1 | tail -30
exit 0
