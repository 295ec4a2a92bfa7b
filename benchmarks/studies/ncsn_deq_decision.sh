#!/usr/bin/env bash
# The image-DEQ decision (issue 59, item 3): the search's winner and its own one-pass control, 3 seeds x 6000 steps
# of experiment=ncsn_mnist_long, FID of 1000 samples at step 6000 (the plan's amendment of 2026-12-02:
# benchmarks/results/notes/ncsn_deq_search_plan.md), read against the campaign's committed TwoRes and RefineNet seeds.
#
#   bash benchmarks/studies/ncsn_deq_decision.sh '<winner>' <data dir> [seeds, default "0 1 2"]
#
# Per seed, the design and its control train side by side (one process each, one thread each: 2 cores), each keeping
# a checkpoint every 1500 steps (the others stay on disk to test later) and testing the last one; the 1000 samples
# behind each FID are kept as uint8 tensors in benchmarks/results/samples/. The two parts are merged into one result
# per seed, kept in the repository (benchmarks/results/ncsn_deq_decision_parts/ncsn_decision_seed<S>.json: commit it
# as it lands, a later session may run on another machine); then every seed there is read by
# benchmarks.tools.generative_seeds into benchmarks/results/ncsn_deq_decision.{json,md}. Resumable: a run that
# reached 6000 steps is not trained again, a killed one continues from its last.ckpt, a tested checkpoint is not
# tested again (benchmarks.tools.training_curves).
set -euo pipefail
winner=${1:?"the winning design's variant name, e.g. 'S4 mdeq_res3_l15'"}
root=${2:?"the data directory (data.root)"}
seeds=${3:-"0 1 2"}
runs=outputs/ncsn_decision
export OMP_NUM_THREADS=1
mkdir -p "$runs" benchmarks/results/samples benchmarks/results/ncsn_deq_decision_parts
for seed in $seeds; do
  parts=()
  for arm in design control; do
    variant=$winner
    [ "$arm" = control ] && variant="$winner (one-pass)"
    python -m benchmarks.tools.training_curves ncsn_search --root "$root" --variants "$variant" --seed "$seed" \
      --steps 6000 --every 1500 --test-every 6000 --fid-samples 1000 --threads 1 --concurrent 2 \
      --keep-fid-samples benchmarks/results/samples --runs "$runs" --out "$runs" \
      --name "ncsn_decision_${arm}_seed${seed}" > "$runs/${arm}_seed${seed}.log" 2>&1 &
    parts+=("$runs/ncsn_decision_${arm}_seed${seed}.json")
  done
  wait
  python -m benchmarks.tools.training_curves ncsn_search --merge "${parts[@]}" \
    --out benchmarks/results/ncsn_deq_decision_parts --name "ncsn_decision_seed${seed}"
done
args=()
for part in benchmarks/results/ncsn_deq_decision_parts/ncsn_decision_seed[0-9].json; do args+=(--part "$part"); done
python -m benchmarks.tools.generative_seeds ncsn_search "${args[@]}" --name ncsn_deq_decision \
  --reference "benchmarks/results/ncsn_mnist_campaign.json:TwoRes-SSM-VR NCSN,SSM-VR NCSN (RefineNet)"
