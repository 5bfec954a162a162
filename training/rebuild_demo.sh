#!/usr/bin/env bash
# Rebuild the bundled demo model (engine/demo_model) from scratch on CPU, in the stages the shipped one went
# through (see training/README.md for what each stage is for and how long it took). Every stage resumes if
# interrupted: run the script again. Progress: `tail -f runs/*/train.log`.
set -euo pipefail
cd "$(dirname "$0")/.."

# 1. From random weights: place-digit number features, curriculum, 1 thread. The shipped run stopped here at
#    step 10066 of a 60000-step cosine schedule (the schedule matters: it sets the learning rate on the way).
redraft train-demo --run-dir runs/stage1 --steps 60000 --stop-at 10066 --threads 1 --no-progress

# 2. Warm start from stage 1 (weights only, fresh optimizer): number rows re-made with Fourier value features
#    (training/train.py, fourier_features), math weighted up, full-size problems from the start, 2 threads.
redraft train-demo --run-dir runs/demo --init-from runs/stage1/ckpt.pt --number-features fourier \
    --steps 16000 --lr 1.5e-3 --curriculum-steps 1 --threads 2 --no-progress \
    --set mtf_start=0 --set 'family_weights={"math": 2.5}'

# 3. Export into the package, then measure it.
python -m redraft.training.export --run-dir runs/demo --out engine/demo_model
redraft eval-demo --plot docs/demo_eval.png
