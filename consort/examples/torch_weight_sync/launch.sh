#!/bin/sh
# One rank of the torch_weight_sync job, as `consort run` or torchrun start
# it: rank 0 is the PyTorch trainer, every other rank a consort worker.
#
#   PYTHON   a python with torch (default: python3)
#   WORKER   the worker binary (default: target/release/examples/torch_weight_sync)
set -e
here=$(dirname "$0")
# torch's ranks never join consort's own rendezvous.
export CONSORT_TORCH_PEERS=1
if [ "${RANK:?launch me with consort run or torchrun}" = 0 ]; then
    exec "${PYTHON:-python3}" "$here/trainer.py"
fi
exec "${WORKER:-${CARGO_TARGET_DIR:-target}/release/examples/torch_weight_sync}"
