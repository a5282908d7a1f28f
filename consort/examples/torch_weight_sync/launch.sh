#!/bin/sh
# One rank of the torch_weight_sync job, as `consort run` or torchrun start
# it: rank 0 is the PyTorch trainer, every other rank a consort worker.
#
#   PYTHON   a python with torch (default: python3)
#   WORKER   the worker binary (default: target/release/examples/torch_weight_sync)
#   BACKEND  gloo (default) or nccl (the worker built with --features nccl)
#   CONSORT_SHARE_GPU=1  every rank on GPU 0 (NCCL below 2.30 then needs
#            one NCCL_HOSTID per rank over sockets, which this sets)
#   EAGER=1  nccl: the trainer binds its default group to the GPU at init
#            (device_id), so torch splits new_groups; the workers are told
set -e
here=$(dirname "$0")
# torch's ranks never join consort's own rendezvous.
export CONSORT_TORCH_PEERS=1
if [ "${BACKEND:-gloo}" = nccl ] && [ "${CONSORT_SHARE_GPU:-0}" = 1 ]; then
    export NCCL_HOSTID="weight-sync-rank-$RANK" NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo
fi
if [ "${EAGER:-0}" = 1 ]; then
    export CONSORT_TORCH_NCCL_EAGER=1
fi
if [ "${RANK:?launch me with consort run or torchrun}" = 0 ]; then
    exec "${PYTHON:-python3}" "$here/trainer.py"
fi
exec "${WORKER:-${CARGO_TARGET_DIR:-target}/release/examples/torch_weight_sync}"
