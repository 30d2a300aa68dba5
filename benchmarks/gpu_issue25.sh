#!/usr/bin/env bash
# issue 25 items 1 and 3 on one card: time to first step (blocking vs background warm-up, cold caches each; then warm)
# and mfu at 1,024 vs 2,048 anchors
set -u
export OUT=${OUT:-/tmp/gout}; C=${CACHES:-/tmp/cc}  # C: the cold runs' own inductor/Triton cache dirs
TORCHINDUCTOR_CACHE_DIR=$C/a TRITON_CACHE_DIR=$C/at FIRST_NAME=fs_blocking FIRST_FLAGS="--trainer.warm-up blocking" FIRST_STEPS=800 FIRST_S=200 bash benchmarks/gpu_session.sh first_step
TORCHINDUCTOR_CACHE_DIR=$C/b TRITON_CACHE_DIR=$C/bt FIRST_NAME=fs_background FIRST_STEPS=800 FIRST_S=200 bash benchmarks/gpu_session.sh first_step
TORCHINDUCTOR_CACHE_DIR=$C/b TRITON_CACHE_DIR=$C/bt FIRST_NAME=fs_background_warm FIRST_STEPS=800 FIRST_S=200 bash benchmarks/gpu_session.sh first_step
FUSED_NAME=fused_1024 ANCHORS=1024 FORMS="flex+compile+fused" FUSED_S=200 bash benchmarks/gpu_session.sh trainer_fused
FUSED_NAME=fused_2048 ANCHORS=2048 FORMS="flex+compile+fused" FUSED_S=200 bash benchmarks/gpu_session.sh trainer_fused
