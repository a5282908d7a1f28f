//! `Backend` for [`NcclBackend`]: each op checks its arguments, classifies
//! its buffers and hands NCCL's enqueue call to the launch.

use std::{ffi::c_int, time::Duration};

use async_trait::async_trait;
use consort_comm::{
    Backend, Buffer, BufferMut, CallOptions, Op, OpKind, ReduceOp, Result, Work, validate,
};

use super::{Enqueue, NcclBackend, grouped, p2p};
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

    fn submit<'a>(&'a self, op: Op<'a>, opts: &CallOptions) -> Work<'a> {
        let o = *opts;
        match op {
            Op::AllReduce { buf, op } => {
                Work::new(async move { self.run_all_reduce(buf, op, &o).await })
            }
            Op::Broadcast { buf } => Work::new(async move { self.run_broadcast(buf, &o).await }),
            Op::Reduce { buf, op } => Work::new(async move { self.run_reduce(buf, op, &o).await }),
            Op::AllGather { output, input } => {
                Work::new(async move { self.run_all_gather(output, input, &o).await })
            }
            Op::Gather { output, input } => {
                Work::new(async move { self.run_gather(output, input, &o).await })
            }
            Op::Scatter { output, input } => {
                Work::new(async move { self.run_scatter(output, input, &o).await })
            }
            Op::ReduceScatter { output, input, op } => {
                Work::new(async move { self.run_reduce_scatter(output, input, op, &o).await })
            }
            Op::AllToAll {
                output,
                input,
                output_splits,
                input_splits,
            } => Work::new(async move {
                self.run_all_to_all_single(output, input, output_splits, input_splits, &o)
                    .await
            }),
            Op::Barrier => Work::new(async move { self.run_barrier(&o).await }),
            Op::Send { buf, dst } => Work::new(async move { self.run_send(buf, dst, &o).await }),
            Op::Recv { buf, src } => Work::new(async move { self.run_recv(buf, src, &o).await }),
        }
    }

    async fn synchronize(&self) -> Result<()> {
        self.wait_for(self.opts.timeout, |t| match &t.poisoned {
            Some(e) => Some(Err(e.to_aborted())),
            None => t.queue.is_empty().then_some(Ok(())),
        })
        .await
    }
}

/// The ops, each checking its arguments, classifying its buffers and
/// handing NCCL's enqueue call to the launch.
impl NcclBackend {
    async fn run_all_reduce(
        &self,
        buf: BufferMut<'_>,
        op: ReduceOp,
        opts: &CallOptions,
    ) -> Result<()> {
        let nop = self.op(op)?;
        self.in_place(OpKind::AllReduce, buf, opts, move |nc, c, s, p, n, dt| {
            // SAFETY: in place on `n` elements of our device.
            unsafe { (nc.all_reduce)(p as *const _, p as *mut _, n, dt, nop, c, s) }
        })
        .await
    }

    async fn run_broadcast(&self, buf: BufferMut<'_>, opts: &CallOptions) -> Result<()> {
        validate::root(opts.root, self.world)?;
        let root = opts.root as c_int;
        self.in_place(OpKind::Broadcast, buf, opts, move |nc, c, s, p, n, dt| {
            // SAFETY: in place on `n` elements of our device.
            unsafe { (nc.broadcast)(p as *const _, p as *mut _, n, dt, root, c, s) }
        })
        .await
    }

    async fn run_reduce(&self, buf: BufferMut<'_>, op: ReduceOp, opts: &CallOptions) -> Result<()> {
        validate::root(opts.root, self.world)?;
        let (nop, root) = (self.op(op)?, opts.root as c_int);
        self.in_place(OpKind::Reduce, buf, opts, move |nc, c, s, p, n, dt| {
            // SAFETY: in place on `n` elements of our device.
            unsafe { (nc.reduce)(p as *const _, p as *mut _, n, dt, nop, root, c, s) }
        })
        .await
    }

    async fn run_all_gather(
        &self,
        output: BufferMut<'_>,
        input: Buffer<'_>,
        opts: &CallOptions,
    ) -> Result<()> {
        validate::same_dtype(output.dtype(), input.dtype())?;
        validate::whole_times_world(output.len(), input.len(), self.world, "all_gather output")?;
        let (n, dt) = (input.len(), nccl_dtype(input.dtype()));
        let args = self.args(Some(input), Some((output, false)))?;
        let enqueue: Enqueue<'_> = Box::new(move |nc, c, s, i, o| {
            // SAFETY: `o` holds world × `n` elements of our device.
            unsafe { (nc.all_gather)(i as *const _, o as *mut _, n, dt, c, s) }
        });
        self.call(OpKind::AllGather, false, opts, args, enqueue)
            .await
    }

    async fn run_gather(
        &self,
        output: Option<BufferMut<'_>>,
        input: Buffer<'_>,
        opts: &CallOptions,
    ) -> Result<()> {
        validate::root(opts.root, self.world)?;
        let is_root = output.is_some();
        validate::root_only("gather", "an output", is_root, self.rank, opts.root)?;
        if let Some(o) = &output {
            validate::same_dtype(o.dtype(), input.dtype())?;
            validate::whole_times_world(o.len(), input.len(), self.world, "gather output")?;
        }
        let (n, dtype, root, world) = (input.len(), input.dtype(), opts.root, self.world);
        let args = self.args(Some(input), output.map(|o| (o, false)))?;
        let enqueue: Enqueue<'_> = Box::new(move |nc, c, s, i, o| {
            let shape = (root, world, is_root);
            Self::rooted(nc, c, s, (i, o), (n, dtype), shape, true)
        });
        self.call(OpKind::Gather, false, opts, args, enqueue).await
    }

    async fn run_scatter(
        &self,
        output: BufferMut<'_>,
        input: Option<Buffer<'_>>,
        opts: &CallOptions,
    ) -> Result<()> {
        validate::root(opts.root, self.world)?;
        let is_root = input.is_some();
        validate::root_only("scatter", "an input", is_root, self.rank, opts.root)?;
        if let Some(i) = &input {
            validate::same_dtype(output.dtype(), i.dtype())?;
            validate::whole_times_world(i.len(), output.len(), self.world, "scatter input")?;
        }
        let (n, dtype, root, world) = (output.len(), output.dtype(), opts.root, self.world);
        let args = self.args(input, Some((output, false)))?;
        let enqueue: Enqueue<'_> = Box::new(move |nc, c, s, i, o| {
            let shape = (root, world, is_root);
            Self::rooted(nc, c, s, (o, i), (n, dtype), shape, false)
        });
        self.call(OpKind::Scatter, false, opts, args, enqueue).await
    }

    async fn run_reduce_scatter(
        &self,
        output: BufferMut<'_>,
        input: Buffer<'_>,
        op: ReduceOp,
        opts: &CallOptions,
    ) -> Result<()> {
        validate::same_dtype(output.dtype(), input.dtype())?;
        validate::whole_times_world(
            input.len(),
            output.len(),
            self.world,
            "reduce_scatter input",
        )?;
        let nop = self.op(op)?;
        let (n, dt) = (output.len(), nccl_dtype(output.dtype()));
        let args = self.args(Some(input), Some((output, false)))?;
        let enqueue: Enqueue<'_> = Box::new(move |nc, c, s, i, o| {
            // SAFETY: `i` holds world × `n` elements of our device.
            unsafe { (nc.reduce_scatter)(i as *const _, o as *mut _, n, dt, nop, c, s) }
        });
        self.call(OpKind::ReduceScatter, false, opts, args, enqueue)
            .await
    }

    async fn run_all_to_all_single(
        &self,
        output: BufferMut<'_>,
        input: Buffer<'_>,
        output_split_sizes: Option<&[usize]>,
        input_split_sizes: Option<&[usize]>,
        opts: &CallOptions,
    ) -> Result<()> {
        validate::same_dtype(output.dtype(), input.dtype())?;
        let outs = validate::splits(output_split_sizes, output.len(), self.world, "output")?;
        let ins = validate::splits(input_split_sizes, input.len(), self.world, "input")?;
        let dtype = input.dtype();
        let args = self.args(Some(input), Some((output, false)))?;
        let enqueue: Enqueue<'_> = Box::new(move |nc, c, s, i, o| {
            let (dt, size) = (nccl_dtype(dtype), dtype.size_bytes() as u64);
            grouped(nc, || {
                let (mut io, mut oo) = (0u64, 0u64);
                let mut r = result::SUCCESS;
                for p in 0..ins.len() {
                    let x = p2p(nc, true, i + io * size, ins[p], dt, p, c, s);
                    let y = p2p(nc, false, o + oo * size, outs[p], dt, p, c, s);
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
        self.call(OpKind::AllToAll, false, opts, args, enqueue)
            .await
    }

    async fn run_barrier(&self, opts: &CallOptions) -> Result<()> {
        // A one-byte all-reduce through the host path: the host returns only
        // once every rank has entered it, as torch's barrier does.
        let mut one = [1u8];
        let sum = sys::op::SUM;
        self.in_place(
            OpKind::Barrier,
            BufferMut::from(&mut one[..]),
            opts,
            move |nc, c, s, p, n, dt| {
                // SAFETY: one byte, in place, on our device (staging).
                unsafe { (nc.all_reduce)(p as *const _, p as *mut _, n, dt, sum, c, s) }
            },
        )
        .await
    }

    async fn run_send(&self, buf: Buffer<'_>, dst: usize, opts: &CallOptions) -> Result<()> {
        validate::peer(dst, self.rank, self.world)?;
        let (n, dt) = (buf.len(), nccl_dtype(buf.dtype()));
        let args = self.args(Some(buf), None)?;
        let enqueue: Enqueue<'_> =
            Box::new(move |nc, c, s, i, _| p2p(nc, true, i, n, dt, dst, c, s));
        self.call(OpKind::Send, true, opts, args, enqueue).await
    }

    async fn run_recv(&self, buf: BufferMut<'_>, src: usize, opts: &CallOptions) -> Result<()> {
        validate::peer(src, self.rank, self.world)?;
        let (n, dt) = (buf.len(), nccl_dtype(buf.dtype()));
        let args = self.args(None, Some((buf, false)))?;
        let enqueue: Enqueue<'_> =
            Box::new(move |nc, c, s, _, o| p2p(nc, false, o, n, dt, src, c, s));
        self.call(OpKind::Recv, true, opts, args, enqueue).await
    }
}
