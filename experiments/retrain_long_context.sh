#!/usr/bin/env bash
# Issue 24: rebuild the bundled models for their whole 1,024-token context, in order.
#   1. the target continues on 1,024-token sequences (`train pair target-long`);
#   2. the draft is distilled again from it at that length (`train pair draft-long`);
#   3. both are exported as checkpoints/code-target and code-draft (`train pair export --long`);
#   4. the Medusa heads, EAGLE head, MTP modules and block drafter continue from the shipped
#      ones for the new target, on 1,024-token sequences (`train heads --init`).
# Every stage resumes from its checkpoints in the work folder: run the script again after an
# interruption and it goes on where it stopped. The work folder needs `specjax train pair data`.
#
#   bash experiments/retrain_long_context.sh [WORKDIR]      (default ~/specjax-work)
set -euo pipefail
cd "$(dirname "$0")/.."
W="${1:-$HOME/specjax-work}"
SJ=.venv/bin/specjax
$SJ train pair target-long --workdir "$W"
$SJ train pair draft-long --workdir "$W"
$SJ train pair export --long --workdir "$W" --out checkpoints
# method, steps, batch size: 0.6-1.0M tokens each, a fifth to a tenth of the first runs (6, 9, 18
# and 11 minutes on the 2-core CPU)
for run in "medusa 300 2" "eagle 500 2" "mtp 300 3" "dflash 150 4"; do
  set -- $run
  $SJ train heads "$1" --target checkpoints/code-target --init "checkpoints/code-$1" \
    --data "$W" --workdir "$W/$1-long" --steps "$2" --batch-size "$3" --seq-len 1024 \
    --learning-rate 5e-4 --out "checkpoints/code-$1"
done
