//! `Backend` for [`NcclBackend`]: `submit` checks a call's arguments once
//! (`validate::op`); each op then classifies its buffers and hands NCCL's
//! enqueue call to the launch.

use std::{ffi::c_int, time::Duration};

use async_trait::async_trait;
use consort_comm::{
    Backend, Buffer, BufferMut, CallOptions, Op, ReduceOp, Result, Shape, Work, validate,
};

use super::{Args, Enqueue, NcclBackend};
use crate::{
    map::nccl_dtype,
    sys::{self, result},
};

#[async_trait]
impl Backend for NcclBackend {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn default_timeout(&self) -> Duration {
        self.opts.timeout
    }

    /// Every call is enqueued here (a host call staged first), so its place
    /// on the stream is fixed when it is made, and its work may be awaited
    /// in any order (see the module docs of `backend`).
    fn submit<'a>(&'a self, op: Op<'a>, opts: &CallOptions) -> Work<'a> {
        let o = *opts;
        // Every argument check, once, before the call takes its place.
        if let Err(e) = validate::op(&op, self.rank, self.world, o.root) {
            return Work::ready(Err(e));
        }
        let fp = op.shape(o.root);
        let made = match op {
            Op::AllReduce { buf, op } => self.run_all_reduce(fp, buf, op, &o),
            Op::Broadcast { buf } => self.run_broadcast(fp, buf, &o),
            Op::Reduce { buf, op } => self.run_reduce(fp, buf, op, &o),
            Op::AllGather { output, input } => self.run_all_gather(fp, output, input, &o),
            Op::Gather { output, input } => self.run_gather(fp, output, input, &o),
            Op::Scatter { output, input } => self.run_scatter(fp, output, input, &o),
            Op::ReduceScatter { output, input, op } => {
                self.run_reduce_scatter(fp, output, input, op, &o)
            }
            Op::AllToAll {
                output,
                input,
                output_splits,
                input_splits,
            } => self.run_all_to_all_single(fp, output, input, output_splits, input_splits, &o),
            Op::Barrier => Ok(self.run_barrier(fp, o)),
            Op::Send { buf, dst } => self.run_send(fp, buf, dst, &o),
            Op::Recv { buf, src } => self.run_recv(fp, buf, src, &o),
        };
        made.unwrap_or_else(|e| Work::ready(Err(e)))
    }

    async fn new_group(
        &self,
        ranks: &[usize],
        opts: &CallOptions,
    ) -> Result<Option<std::sync::Arc<dyn Backend>>> {
        self.make_subgroup(ranks, opts).await
    }

    async fn synchronize(&self) -> Result<()> {
        self.shared.synchronize(self.opts.timeout).await
    }

    /// The ranks the fingerprint check's side channel has seen go (NCCL
    /// itself names none): none without a check.
    fn lost_peers(&self) -> Vec<(usize, String)> {
        self.shared.lost_peers()
    }
}

/// The ops, their arguments already checked: each classifies its buffers
/// and hands NCCL's enqueue call to the launch.
impl NcclBackend {
    fn run_all_reduce<'a>(
        &'a self,
        fp: Shape,
        buf: BufferMut<'a>,
        op: ReduceOp,
        opts: &CallOptions,
    ) -> Result<Work<'a>> {
        let nop = self.op(op, buf.dtype())?;
        self.in_place(fp, buf, opts, move |on, p, n, dt| {
            let (nc, c, s) = (on.nccl, on.comm, on.stream);
            on.with_op(nop, dt, |o| {
                // SAFETY: in place on `n` elements of our device.
                unsafe { (nc.all_reduce)(p as *const _, p as *mut _, n, dt, o, c, s) }
            })
        })
    }

    fn run_broadcast<'a>(
        &'a self,
        fp: Shape,
        buf: BufferMut<'a>,
        opts: &CallOptions,
    ) -> Result<Work<'a>> {
        let root = opts.root as c_int;
        self.in_place(fp, buf, opts, move |on, p, n, dt| {
            let (nc, c, s) = (on.nccl, on.comm, on.stream);
            // SAFETY: in place on `n` elements of our device.
            on.settle(unsafe { (nc.broadcast)(p as *const _, p as *mut _, n, dt, root, c, s) })
        })
    }

    fn run_reduce<'a>(
        &'a self,
        fp: Shape,
        buf: BufferMut<'a>,
        op: ReduceOp,
        opts: &CallOptions,
    ) -> Result<Work<'a>> {
        let (nop, root) = (self.op(op, buf.dtype())?, opts.root as c_int);
        self.in_place(fp, buf, opts, move |on, p, n, dt| {
            let (nc, c, s) = (on.nccl, on.comm, on.stream);
            on.with_op(nop, dt, |o| {
                // SAFETY: in place on `n` elements of our device.
                unsafe { (nc.reduce)(p as *const _, p as *mut _, n, dt, o, root, c, s) }
            })
        })
    }

    fn run_all_gather<'a>(
        &'a self,
        fp: Shape,
        output: BufferMut<'a>,
        input: Buffer<'a>,
        opts: &CallOptions,
    ) -> Result<Work<'a>> {
        let (n, dt) = (input.len(), nccl_dtype(input.dtype()));
        let args = self.args(Some(input), Some((output, false)))?;
        let enqueue: Enqueue<'_> = Box::new(move |on, i, o| {
            let (nc, c, s) = (on.nccl, on.comm, on.stream);
            // SAFETY: `o` holds world × `n` elements of our device.
            on.settle(unsafe { (nc.all_gather)(i as *const _, o as *mut _, n, dt, c, s) })
        });
        Ok(self.call(fp, opts, args, enqueue))
    }

    fn run_gather<'a>(
        &'a self,
        fp: Shape,
        output: Option<BufferMut<'a>>,
        input: Buffer<'a>,
        opts: &CallOptions,
    ) -> Result<Work<'a>> {
        let is_root = output.is_some();
        let (n, dtype, root, world) = (input.len(), input.dtype(), opts.root, self.world);
        let args = self.args(Some(input), output.map(|o| (o, false)))?;
        let enqueue: Enqueue<'_> =
            Box::new(move |on, i, o| on.rooted((i, o), (n, dtype), (root, world, is_root), true));
        Ok(self.call(fp, opts, args, enqueue))
    }

    fn run_scatter<'a>(
        &'a self,
        fp: Shape,
        output: BufferMut<'a>,
        input: Option<Buffer<'a>>,
        opts: &CallOptions,
    ) -> Result<Work<'a>> {
        let is_root = input.is_some();
        let (n, dtype, root, world) = (output.len(), output.dtype(), opts.root, self.world);
        let args = self.args(input, Some((output, false)))?;
        let enqueue: Enqueue<'_> =
            Box::new(move |on, i, o| on.rooted((o, i), (n, dtype), (root, world, is_root), false));
        Ok(self.call(fp, opts, args, enqueue))
    }

    fn run_reduce_scatter<'a>(
        &'a self,
        fp: Shape,
        output: BufferMut<'a>,
        input: Buffer<'a>,
        op: ReduceOp,
        opts: &CallOptions,
    ) -> Result<Work<'a>> {
        let nop = self.op(op, output.dtype())?;
        let (n, dt) = (output.len(), nccl_dtype(output.dtype()));
        let args = self.args(Some(input), Some((output, false)))?;
        let enqueue: Enqueue<'_> = Box::new(move |on, i, o| {
            let (nc, c, s) = (on.nccl, on.comm, on.stream);
            on.with_op(nop, dt, |op| {
                // SAFETY: `i` holds world × `n` elements of our device.
                unsafe { (nc.reduce_scatter)(i as *const _, o as *mut _, n, dt, op, c, s) }
            })
        });
        Ok(self.call(fp, opts, args, enqueue))
    }

    fn run_all_to_all_single<'a>(
        &'a self,
        fp: Shape,
        output: BufferMut<'a>,
        input: Buffer<'a>,
        output_split_sizes: Option<&[usize]>,
        input_split_sizes: Option<&[usize]>,
        opts: &CallOptions,
    ) -> Result<Work<'a>> {
        let outs = validate::splits(output_split_sizes, output.len(), self.world, "output")?;
        let ins = validate::splits(input_split_sizes, input.len(), self.world, "input")?;
        let dtype = input.dtype();
        let args = self.args(Some(input), Some((output, false)))?;
        let enqueue: Enqueue<'_> = Box::new(move |on, i, o| {
            let (dt, size) = (nccl_dtype(dtype), dtype.size_bytes() as u64);
            on.grouped(|| {
                let (mut io, mut oo) = (0u64, 0u64);
                let mut r = result::SUCCESS;
                for p in 0..ins.len() {
                    let x = on.p2p(true, i + io * size, ins[p], dt, p);
                    let y = on.p2p(false, o + oo * size, outs[p], dt, p);
                    io += ins[p] as u64;
                    oo += outs[p] as u64;
                    for z in [x, y] {
                        if r == result::SUCCESS {
                            r = z;
                        }
                    }
                }
                r
            })
        });
        Ok(self.call(fp, opts, args, enqueue))
    }

    fn run_barrier(&self, fp: Shape, opts: CallOptions) -> Work<'_> {
        // A one-byte all-reduce through the host path: the host returns only
        // once every rank has entered it, as torch's barrier does. It is
        // staged and enqueued now, as every host call is.
        let (sum, dt) = (sys::op::SUM, nccl_dtype(consort_comm::DType::U8));
        let enqueue: Enqueue<'_> = Box::new(move |on, i, _| {
            let (nc, c, s) = (on.nccl, on.comm, on.stream);
            // SAFETY: one byte, in place, on our device (staging).
            on.settle(unsafe { (nc.all_reduce)(i as *const _, i as *mut _, 1, dt, sum, c, s) })
        });
        let args = Args::Host {
            input: Some(&[1u8]),
            output: None,
        };
        self.call(fp, &opts, args, enqueue)
    }

    fn run_send<'a>(
        &'a self,
        fp: Shape,
        buf: Buffer<'a>,
        dst: usize,
        opts: &CallOptions,
    ) -> Result<Work<'a>> {
        let (n, dt) = (buf.len(), nccl_dtype(buf.dtype()));
        let args = self.args(Some(buf), None)?;
        let enqueue: Enqueue<'_> = Box::new(move |on, i, _| on.settle(on.p2p(true, i, n, dt, dst)));
        Ok(self.call_with(fp, opts, args, (enqueue, Some(dst))))
    }

    fn run_recv<'a>(
        &'a self,
        fp: Shape,
        buf: BufferMut<'a>,
        src: usize,
        opts: &CallOptions,
    ) -> Result<Work<'a>> {
        let (n, dt) = (buf.len(), nccl_dtype(buf.dtype()));
        let args = self.args(None, Some((buf, false)))?;
        let enqueue: Enqueue<'_> =
            Box::new(move |on, _, o| on.settle(on.p2p(false, o, n, dt, src)));
        Ok(self.call_with(fp, opts, args, (enqueue, Some(src))))
    }
}
