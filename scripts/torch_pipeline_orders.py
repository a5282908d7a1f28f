"""Prints, as JSON, the action order torch's pipeline schedules run on every rank,
for a grid of (schedule, pipeline ranks, microbatches, stages per rank).

consort's pipeline/tests/schedules.rs requires its schedules to equal this
(pipeline/tests/golden/torch_orders.json was made by this script; CI reruns it
against the installed torch and requires the same output).

- Multi-stage schedules (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
  ZBVZeroBubble, DualPipeV) run their `pipeline_order` (the runtime executes it
  action by action): that list is printed, `None` slots (bubbles) included.
- Single-stage schedules (GPipe, 1F1B) run imperative code
  (`_step_microbatches`); their `pipeline_order` is only for display, and in
  torch 2.15 numbers the last rank's 1F1B forwards from 1. So for them this
  script runs `_step_microbatches` against a mock stage, with the
  point-to-point calls stubbed, and prints the forward/backward calls made.

A configuration torch refuses prints {"error": "..."}.

Usage: python torch_pipeline_orders.py > torch_orders.json
"""
import json
import sys
import warnings
from unittest import mock

warnings.filterwarnings("ignore")
import torch.distributed.pipelining.schedules as S  # noqa: E402
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops  # noqa: E402

SINGLE = {"GPipe": S.ScheduleGPipe, "1F1B": S.Schedule1F1B}
MULTI = ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


def executed(cls, pp, m):
    out = []
    for r in range(pp):
        st = mock.MagicMock()
        st.group_rank, st.group_size, st.num_stages, st.stage_index = r, pp, pp, r
        st.submod, st.p2p_per_edge, st.device = None, False, "cpu"
        st.is_first, st.is_last = r == 0, r == pp - 1
        st.stage_index_to_group_rank = {i: i for i in range(pp)}
        for f in ("get_fwd_recv_ops", "get_fwd_send_ops", "get_bwd_recv_ops", "get_bwd_send_ops"):
            getattr(st, f).return_value = []
        rec = []
        st.forward_one_chunk.side_effect = lambda i, *a, _r=r, _rec=rec, **k: _rec.append(f"{_r}F{i}")
        st.backward_one_chunk.side_effect = lambda i, *a, _r=r, _rec=rec, **k: _rec.append(f"{_r}B{i}")
        sch = cls(st, m)
        with mock.patch.object(S, "_wait_and_release_fwd_send", lambda *a, **k: None):
            sch._step_microbatches([()] * m, [{}] * m, None, None)
        out.append(rec)
    return out


def row(name, pp, m, spr):
    r = {"schedule": name, "pp": pp, "microbatches": m, "stages_per_rank": spr}
    try:
        if name in SINGLE:
            r["orders"] = executed(SINGLE[name], pp, m)
        else:
            ops = get_schedule_ops(name, pp, m, spr)
            r["orders"] = [[None if a is None else str(a) for a in rank] for rank in ops]
    except Exception as e:  # torch refuses this configuration
        r["error"] = f"{type(e).__name__}: {e}"
    return r


rows = []
for pp in range(1, 5):
    for m in range(1, 9):
        for name in SINGLE:
            rows.append(row(name, pp, m, 1))
        for name in MULTI:
            for spr in (2, 3):
                rows.append(row(name, pp, m, spr))
json.dump(rows, sys.stdout, indent=0)
sys.stdout.write("\n")
