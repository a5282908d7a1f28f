//! [`GlooBackend`]: a consort rank as a member of a torch `gloo` process
//! group, speaking Gloo's TCP pair protocol and running the algorithms
//! torch's `ProcessGroupGloo` runs, message for message.
//!
//! This module owns torch's side of the contract: the store keys a torch
//! `gloo` group rendezvouses under ([`torch_group_store`]), the tags torch
//! gives its collectives (one per collective, counted per group from 0,
//! none for send and recv), and how torch maps each op onto Gloo
//! (`reduce_scatter_tensor` is an all_reduce of the whole input, AVG is a
//! sum divided afterwards). The schedules are `consort_comm::algo::gloo`'s;
//! the sockets are [`pairs`]'; the rendezvous is [`connect`]'s; the bytes'
//! layout is [`wire`]'s.
//!
//! Gloo has no room on the wire for consort's call check, so a mismatched
//! call is what it is under torch: a size mismatch is refused, anything
//! else runs until the call's deadline and then fails the group on every
//! rank (its sockets close, so torch's ranks fail too).

pub mod connect;
pub mod pairs;
mod rules;
pub mod wire;

use std::{
    collections::{HashMap, VecDeque},
    net::IpAddr,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};

use async_trait::async_trait;
use consort_comm::{
    Backend, Buffer, BufferMut, CallOptions, CommError, DType, ErrorContext, GroupId, Op, OpKind,
    ReduceOp, Result, Work,
    algo::gloo::{self as algo, GlooIo},
    reduce::divide_bytes,
    store::{PrefixStore, Store},
};
use tokio::time::Instant;

use pairs::Pairs;
use rules::{Outs, Rules};

/// torch's default timeout for a `gloo` group (`kBackendDefaultTimeout`).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// How a [`GlooBackend`] joins its group.
#[derive(Clone, Debug)]
pub struct GlooOptions {
    /// The default deadline of a call, and of the rendezvous.
    pub timeout: Duration,
    /// The address this rank listens on; `None`: as torch picks it
    /// ([`listen_ip`]).
    pub ip: Option<IpAddr>,
    /// The launcher's heartbeat file (`CONSORT_HEARTBEAT_FILE`): each call
    /// made and ended shows there, so `consort run --watchdog-timeout`
    /// names a rank that stops making progress.
    pub heartbeat_file: Option<PathBuf>,
    /// The job's flight record directory (`CONSORT_FLIGHT_DIR`): this
    /// rank's calls on the group and its subgroups are written to
    /// `rank-K.json` when one fails and on SIGUSR1.
    pub flight_dir: Option<PathBuf>,
}

impl Default for GlooOptions {
    fn default() -> Self {
        GlooOptions {
            timeout: DEFAULT_TIMEOUT,
            ip: None,
            heartbeat_file: None,
            flight_dir: None,
        }
    }
}

/// The store a torch `gloo` group named `group_name` rendezvouses in, given
/// the job's store as `init_process_group` sees it (torch puts its default
/// group under `default_pg` when it made the store from `init_method`, as
/// under torchrun): `{default_pg}/0/` for the default group, and
/// `{default_pg}/0//{name}/` for the `new_group`s, each then under the
/// device (`cpu/`) and Gloo's context index (`0`).
pub fn torch_group_store(job: Arc<dyn Store>, group_name: &str) -> PrefixStore {
    let default_pg: Arc<dyn Store> = Arc::new(PrefixStore::new("default_pg", job));
    let world: Arc<dyn Store> = Arc::new(PrefixStore::new("0/", default_pg));
    let group: Arc<dyn Store> = if group_name == "0" {
        world
    } else {
        Arc::new(PrefixStore::new(format!("{group_name}/"), world))
    };
    let device: Arc<dyn Store> = Arc::new(PrefixStore::new("cpu/", group));
    PrefixStore::new("0", device)
}

/// The address torch's Gloo would listen on: `GLOO_SOCKET_IFNAME`'s
/// interface if set, else this host's name if it resolves to an address
/// this process can bind, else 127.0.0.1 (`createDefaultDevice`).
pub async fn listen_ip() -> Result<IpAddr> {
    if let Ok(ifname) = std::env::var("GLOO_SOCKET_IFNAME")
        && !ifname.trim().is_empty()
    {
        let ifname = ifname.trim();
        if ifname.contains(',') {
            return Err(CommError::unsupported(format!(
                "GLOO_SOCKET_IFNAME={ifname} names several interfaces (torch then makes one \
                 Gloo context per interface); consort joins Gloo groups over one: name one"
            )));
        }
        return crate::iface::interface_addr(ifname)
            .map_err(|e| CommError::invalid(format!("GLOO_SOCKET_IFNAME={ifname}: {e}")));
    }
    let host = connect::hostname();
    if let Ok(addrs) = tokio::net::lookup_host((host.as_str(), 0)).await {
        for a in addrs {
            if std::net::TcpListener::bind((a.ip(), 0)).is_ok() {
                return Ok(a.ip());
            }
        }
    }
    Ok(IpAddr::from([127, 0, 0, 1]))
}

/// Refuses the torch settings under which torch's ranks would do what this
/// backend does not (launchers pass one environment to every rank):
/// `TORCH_GLOO_LAZY_INIT=1` (torch's ranks connect on first use) and
/// `TORCH_DIST_INIT_BARRIER=1` (a store barrier after init).
fn refuse_torch_modes() -> Result<()> {
    for (var, what) in [
        (
            "TORCH_GLOO_LAZY_INIT",
            "torch's Gloo ranks then connect on first use; consort connects at init",
        ),
        (
            "TORCH_DIST_INIT_BARRIER",
            "torch's ranks then wait in a store barrier after init that consort does not join",
        ),
    ] {
        if let Ok(v) = std::env::var(var)
            && matches!(v.trim(), "1" | "true" | "True" | "TRUE" | "y" | "yes")
        {
            return Err(CommError::unsupported(format!(
                "{var}={v}: {what}; unset it for jobs with consort ranks"
            )));
        }
    }
    Ok(())
}

/// One rank's handle on a torch `gloo` process group.
#[derive(Debug)]
pub struct GlooBackend {
    pairs: Arc<Pairs>,
    timeout: Duration,
    /// The next collective's tag (torch's `collectiveCounter_`).
    tag: AtomicU32,
    /// The engine's local rules: sequence numbers, the sticky failure,
    /// deadlines, the flight record and the heartbeat.
    rules: Arc<Rules>,
    /// Where this group and its subgroups keep their heartbeat and record.
    outs: Outs,
    group: GroupId,
    /// The job's store and listening address, for subgroups.
    job: Arc<dyn Store>,
    ip: IpAddr,
    /// How many groups torch has named so far in this job (shared by a
    /// world and its subgroups): `new_group` takes the next.
    groups: Arc<AtomicU32>,
    /// The ranks of this group in the world (subgroups only).
    world_ranks: Option<Vec<usize>>,
}

impl GlooBackend {
    /// Joins the default group (`"0"`) of a torch job whose store is `job`,
    /// as rank `rank` of `size`.
    pub async fn connect(
        job: Arc<dyn Store>,
        rank: usize,
        size: usize,
        opts: GlooOptions,
    ) -> Result<GlooBackend> {
        refuse_torch_modes()?;
        let ip = match opts.ip {
            Some(ip) => ip,
            None => listen_ip().await?,
        };
        let groups = Arc::new(AtomicU32::new(1));
        let outs = Outs::new(
            opts.heartbeat_file.as_deref(),
            opts.flight_dir.as_deref(),
            (rank, size),
        );
        let at = (rank, size, ip);
        Self::join(job, "0", at, opts.timeout, (groups, outs), None).await
    }

    async fn join(
        job: Arc<dyn Store>,
        name: &str,
        (rank, size, ip): (usize, usize, IpAddr),
        timeout: Duration,
        (groups, outs): (Arc<AtomicU32>, Outs),
        world_ranks: Option<Vec<usize>>,
    ) -> Result<GlooBackend> {
        if rank >= size {
            return Err(CommError::invalid(format!(
                "rank {rank} is not in a group of {size}"
            )));
        }
        let store = torch_group_store(job.clone(), name);
        let streams = connect::full_mesh(&store, rank, size, ip, timeout)
            .await
            .map_err(|e| {
                e.with_context(ErrorContext {
                    rank: Some(rank),
                    ..Default::default()
                })
            })?;
        let group = match &world_ranks {
            None => GroupId::WORLD,
            Some(r) => GroupId::subgroup(GroupId::WORLD, r),
        };
        Ok(GlooBackend {
            pairs: Pairs::start(rank, streams),
            timeout,
            tag: AtomicU32::new(0),
            rules: Rules::new(group, (rank, size), &outs),
            outs,
            group,
            job,
            ip,
            groups,
            world_ranks,
        })
    }

    /// The context of an error of a call not yet made (no sequence
    /// number).
    fn context(&self, op: OpKind) -> ErrorContext {
        ErrorContext {
            op: Some(op),
            rank: Some(self.pairs.rank()),
            group: (self.group != GroupId::WORLD).then_some(self.group),
            ..Default::default()
        }
    }
}

impl Drop for GlooBackend {
    /// Closes the group's connections (its reader and writer tasks would
    /// otherwise keep them open), as torch's `destroy_process_group`.
    fn drop(&mut self) {
        self.pairs.close();
    }
}

/// One call's view of the pairs: its deadline on every wait, and the sends
/// it must see written before it ends.
struct CallIo<'a> {
    pairs: &'a Pairs,
    deadline: Instant,
    after: Duration,
    sends: std::sync::Mutex<Vec<pairs::SendId>>,
    /// The call's posted receives per (peer, slot), oldest first.
    tickets: std::sync::Mutex<HashMap<(usize, u64), VecDeque<pairs::RecvTicket>>>,
}

impl<'a> CallIo<'a> {
    /// A call on `pairs` that has `after` to finish, by `deadline`.
    fn new(pairs: &'a Pairs, deadline: std::time::Instant, after: Duration) -> CallIo<'a> {
        CallIo {
            pairs,
            deadline: Instant::from_std(deadline),
            after,
            sends: Default::default(),
            tickets: Default::default(),
        }
    }

    /// Waits for every send this call posted to be written.
    async fn flush(&self) -> Result<()> {
        let sends = std::mem::take(&mut *consort_comm::lock(&self.sends));
        self.pairs
            .wait_sent(&sends, self.deadline, self.after)
            .await
    }
}

#[async_trait]
impl GlooIo for CallIo<'_> {
    fn rank(&self) -> usize {
        self.pairs.rank()
    }
    fn size(&self) -> usize {
        self.pairs.size()
    }
    fn post_send(&self, peer: usize, slot: u64, data: &[u8]) -> Result<()> {
        let id = self.pairs.post_send(peer, slot, data)?;
        consort_comm::lock(&self.sends).push(id);
        Ok(())
    }
    fn post_recv(&self, peer: usize, slot: u64, len: usize) -> Result<()> {
        let ticket = self.pairs.post_recv(peer, slot, len)?;
        let mut t = consort_comm::lock(&self.tickets);
        t.entry((peer, slot)).or_default().push_back(ticket);
        Ok(())
    }
    async fn wait_recv(&self, peer: usize, slot: u64) -> Result<Vec<u8>> {
        let ticket = {
            let mut t = consort_comm::lock(&self.tickets);
            let q = t.get_mut(&(peer, slot));
            let ticket = q.and_then(VecDeque::pop_front);
            if t.get(&(peer, slot)).is_some_and(VecDeque::is_empty) {
                t.remove(&(peer, slot));
            }
            ticket.ok_or_else(|| {
                CommError::invalid(format!(
                    "a wait for rank {peer}'s payload on Gloo slot {slot:#x} without a posted \
                     receive"
                ))
            })?
        };
        self.pairs
            .wait_recv(peer, slot, ticket, self.deadline, self.after)
            .await
    }
    fn recycle(&self, data: Vec<u8>) {
        self.pairs.recycle(data);
    }
}

/// Posts a send's or a receive's message when the call is made, so that
/// p2p calls on one tag and peer match in the order they were made (as
/// torch's), whichever is awaited first.
fn post_p2p(io: &CallIo<'_>, op: &Op<'_>, tag: u32) -> Result<()> {
    let slot = u64::from(tag);
    match op {
        Op::Send { buf, dst } => match buf {
            Buffer::Host(h) => io.post_send(*dst, slot, h.bytes()),
            Buffer::Device(_) => Err(CommError::unsupported(
                "the gloo backend works on host memory and got a device buffer; copy it to the \
                 host first, or use the nccl backend for GPU memory",
            )),
        },
        Op::Recv {
            buf: BufferMut::Host(h),
            src,
        } => io.post_recv(*src, slot, h.bytes().len()),
        Op::Recv { .. } => Err(CommError::unsupported(
            "the gloo backend works on host memory and got a device buffer; copy it to the \
             host first, or use the nccl backend for GPU memory",
        )),
        _ => Ok(()),
    }
}

/// Fails the group if a call is dropped before it finishes: its peers may
/// be part-way through it (the engine's cancel rule, with the dropper's
/// cause), and its connections close so that torch's ranks fail too.
struct Unfinished<'a> {
    pairs: &'a Pairs,
    rules: &'a Rules,
    id: consort_comm::engine::CallId,
    done: bool,
}

impl Drop for Unfinished<'_> {
    fn drop(&mut self) {
        if !self.done
            && let Some(e) = self.rules.cancel(self.id)
        {
            self.pairs.fail(e);
        }
    }
}

fn host(buf: BufferMut<'_>) -> Result<(DType, &mut [u8])> {
    let h = buf.host("gloo")?;
    Ok((h.dtype(), h.into_bytes_mut()))
}

fn combine_with(op: ReduceOp, dtype: DType) -> Result<impl Fn(&mut [u8], &[u8]) -> Result<()>> {
    let base = match op {
        ReduceOp::Avg => ReduceOp::Sum,
        ReduceOp::PremulSum(_) => {
            return Err(CommError::unsupported(
                "PREMUL_SUM is not a Gloo reduction (torch: \"Cannot use ReduceOp.PREMUL_SUM \
                 with Gloo\")",
            ));
        }
        other => other,
    };
    base.check(dtype)?;
    Ok(move |dst: &mut [u8], src: &[u8]| match base {
        ReduceOp::Min | ReduceOp::Max if dtype.is_float() => {
            float_min_max(base, dtype, dst, src);
            Ok(())
        }
        _ => base.apply_bytes(dtype, dst, src),
    })
}

/// Gloo's `min` and `max` on floats: `std::min(ours, theirs)` keeps ours
/// unless theirs is smaller, so a NaN on the far side is dropped and one on
/// our side kept (consort's own MIN and MAX propagate NaN from either).
/// f16 and bf16 compare as f32, as `c10::Half` does.
fn float_min_max(op: ReduceOp, dtype: DType, dst: &mut [u8], src: &[u8]) {
    let n = dtype.size_bytes();
    let pick = |a: f64, b: f64| match op {
        ReduceOp::Min => b < a,
        _ => a < b,
    };
    for (d, s) in dst.chunks_exact_mut(n).zip(src.chunks_exact(n)) {
        let (a, b) = match dtype {
            DType::F32 => (
                f64::from(f32::from_ne_bytes(d.try_into().expect("4 bytes"))),
                f64::from(f32::from_ne_bytes(s.try_into().expect("4 bytes"))),
            ),
            DType::F64 => (
                f64::from_ne_bytes(d.try_into().expect("8 bytes")),
                f64::from_ne_bytes(s.try_into().expect("8 bytes")),
            ),
            DType::F16 => (
                half::f16::from_ne_bytes(d.try_into().expect("2 bytes")).to_f64(),
                half::f16::from_ne_bytes(s.try_into().expect("2 bytes")).to_f64(),
            ),
            _ => (
                half::bf16::from_ne_bytes(d.try_into().expect("2 bytes")).to_f64(),
                half::bf16::from_ne_bytes(s.try_into().expect("2 bytes")).to_f64(),
            ),
        };
        if pick(a, b) {
            d.copy_from_slice(s);
        }
    }
}

/// torch's all_reduce on Gloo: the ring, then AVG's division.
async fn all_reduce(
    io: &CallIo<'_>,
    tag: u32,
    dtype: DType,
    buf: &mut [u8],
    op: ReduceOp,
) -> Result<()> {
    let combine = combine_with(op, dtype)?;
    algo::allreduce(io, tag, buf, dtype.size_bytes(), &combine).await?;
    if matches!(op, ReduceOp::Avg) {
        divide_bytes(dtype, buf, io.size())?;
    }
    Ok(())
}

/// torch's reduce_scatter_tensor on Gloo: an all_reduce of a copy of the
/// whole input (aligned, as a tensor is), then this rank's part.
async fn reduce_scatter(
    io: &CallIo<'_>,
    tag: u32,
    output: BufferMut<'_>,
    input: Buffer<'_>,
    op: ReduceOp,
) -> Result<()> {
    let (dtype, out) = host(output)?;
    let input = input.host("gloo")?.bytes();
    let mut words = vec![0u64; input.len().div_ceil(8)];
    let whole = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..input.len()];
    whole.copy_from_slice(input);
    all_reduce(io, tag, dtype, whole, op).await?;
    let part = out.len();
    let at = io.rank() * part;
    out.copy_from_slice(&whole[at..at + part]);
    Ok(())
}

/// torch's reduce on Gloo: gloo's reduce, then AVG's division on every
/// rank (torch divides everywhere).
async fn reduce(
    io: &CallIo<'_>,
    tag: u32,
    buf: BufferMut<'_>,
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let (dtype, bytes) = host(buf)?;
    let combine = combine_with(op, dtype)?;
    algo::reduce(io, tag, bytes, dtype.size_bytes(), root, &combine).await?;
    if matches!(op, ReduceOp::Avg) {
        divide_bytes(dtype, bytes, io.size())?;
    }
    Ok(())
}

impl GlooBackend {
    /// Runs `op` as torch's `ProcessGroupGloo` does, under `tag` (for
    /// collectives) and the call's deadline.
    async fn run(&self, op: Op<'_>, opts: CallOptions, tag: u32, io: &CallIo<'_>) -> Result<()> {
        match op {
            Op::AllReduce { buf, op } => {
                let (dtype, bytes) = host(buf)?;
                all_reduce(io, tag, dtype, bytes, op).await
            }
            Op::Broadcast { buf } => {
                let (_, bytes) = host(buf)?;
                algo::broadcast(io, tag, bytes, opts.root).await
            }
            Op::AllGather { output, input } => {
                let (_, out) = host(output)?;
                let input = input.host("gloo")?.bytes();
                algo::allgather(io, tag, out, input).await
            }
            Op::ReduceScatter { output, input, op } => {
                reduce_scatter(io, tag, output, input, op).await
            }
            Op::Barrier => algo::barrier(io, tag).await,
            Op::Reduce { buf, op } => reduce(io, tag, buf, op, opts.root).await,
            Op::Gather { output, input } => {
                let out = match output {
                    Some(o) => Some(host(o)?.1),
                    None => None,
                };
                algo::gather(io, tag, out, input.host("gloo")?.bytes(), opts.root).await
            }
            Op::Scatter { output, input } => {
                let input = match input {
                    Some(i) => Some(i.host("gloo")?.bytes()),
                    None => None,
                };
                algo::scatter(io, tag, host(output)?.1, input, opts.root).await
            }
            Op::AllToAll {
                output,
                input,
                output_splits: None,
                input_splits: None,
            } => algo::alltoall(io, tag, host(output)?.1, input.host("gloo")?.bytes()).await,
            // Posted in submit (see `post_p2p`): the send waits for its
            // payload to go in flush, the receive for its payload here.
            Op::Send { .. } => Ok(()),
            Op::Recv { buf, src } => {
                let (_, bytes) = host(buf)?;
                let slot = u64::from(opts.tag);
                let data = io.wait_recv(src, slot).await?;
                if data.len() != bytes.len() {
                    return Err(CommError::invalid(format!(
                        "recv of {} bytes from rank {src} (tag {}) got {} bytes: the send and \
                         the recv differ in size",
                        bytes.len(),
                        opts.tag,
                        data.len()
                    )));
                }
                bytes.copy_from_slice(&data);
                io.recycle(data);
                Ok(())
            }
            Op::AllToAll { .. } => Err(CommError::unsupported(
                "all_to_all_single with split sizes (gloo's alltoallv) on the gloo backend; \
                 equal parts work",
            )),
        }
    }
}

#[async_trait]
impl Backend for GlooBackend {
    fn name(&self) -> &'static str {
        "gloo"
    }

    fn rank(&self) -> usize {
        self.pairs.rank()
    }

    fn world_size(&self) -> usize {
        self.pairs.size()
    }

    fn group_id(&self) -> GroupId {
        self.group
    }

    fn default_timeout(&self) -> Duration {
        self.timeout
    }

    fn may_add_calls(&self) -> bool {
        false
    }

    fn submit<'a>(&'a self, op: Op<'a>, opts: &CallOptions) -> Work<'a> {
        let kind = op.kind();
        let (rank, size) = (self.pairs.rank(), self.pairs.size());
        if let Err(e) = consort_comm::validate::op(&op, rank, size, opts.root) {
            return Work::ready(Err(e.with_context(self.context(kind))));
        }
        if let Some(e) = self.pairs.failure() {
            return Work::ready(Err(e.to_aborted().with_context(self.context(kind))));
        }
        let opts = *opts;
        let timeout = opts.timeout_or(self.timeout);
        let call = match self.rules.begin(&op, opts.root, timeout) {
            Ok(c) => c,
            Err(e) => return Work::ready(Err(e)),
        };
        // Collectives take torch's next tag now, in call order; send and
        // recv use the caller's tag as their slot.
        let tag = match kind {
            OpKind::Send | OpKind::Recv => 0,
            _ => self.tag.fetch_add(1, Ordering::Relaxed),
        };
        let io = CallIo::new(&self.pairs, call.deadline, timeout);
        if let Err(e) = post_p2p(&io, &op, opts.tag) {
            return Work::ready(Err(self.rules.refuse(call.id, e)));
        }
        let guard = Unfinished {
            pairs: &self.pairs,
            rules: &self.rules,
            id: call.id,
            done: false,
        };
        Work::new(async move {
            let mut guard = guard;
            let res = match self.run(op, opts, tag, &io).await {
                Ok(()) => io.flush().await,
                // Refused before a message went: the group goes on.
                Err(e @ (CommError::InvalidArgument { .. } | CommError::Unsupported { .. })) => {
                    guard.done = true;
                    return Err(self.rules.refuse(call.id, e));
                }
                // Part-way through: the peers cannot finish the call.
                Err(e) => {
                    self.pairs.fail(e.clone().with_context(call.ctx));
                    Err(e)
                }
            };
            guard.done = true;
            self.rules.end(call.id, res)
        })
    }

    async fn new_group(
        &self,
        ranks: &[usize],
        opts: &CallOptions,
    ) -> Result<Option<Arc<dyn Backend>>> {
        if self.world_ranks.is_some() {
            return Err(CommError::unsupported(
                "torch makes Gloo subgroups from the world group: call new_group on the world",
            ));
        }
        let name = self.groups.fetch_add(1, Ordering::Relaxed).to_string();
        let Some(me) = ranks.iter().position(|&r| r == self.rank()) else {
            return Ok(None);
        };
        let timeout = opts.timeout.unwrap_or(self.timeout);
        let at = (me, ranks.len(), self.ip);
        let shared = (self.groups.clone(), self.outs.clone());
        let b = Self::join(
            self.job.clone(),
            &name,
            at,
            timeout,
            shared,
            Some(ranks.to_vec()),
        )
        .await?;
        Ok(Some(Arc::new(b)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_ne_bytes()).collect()
    }

    fn back(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
            .collect()
    }

    /// `std::min(ours, theirs)`: a NaN that arrives is dropped, one already
    /// here is kept (consort's own MIN would give NaN both times).
    #[test]
    fn min_and_max_keep_our_value_against_nan_as_gloo_does() {
        let min = combine_with(ReduceOp::Min, DType::F32).unwrap();
        let mut ours = f32s(&[1.0, f32::NAN, 3.0]);
        min(&mut ours, &f32s(&[f32::NAN, 2.0, 0.5])).unwrap();
        let got = back(&ours);
        assert_eq!(got[0], 1.0);
        assert!(got[1].is_nan());
        assert_eq!(got[2], 0.5);

        let max = combine_with(ReduceOp::Max, DType::BF16).unwrap();
        let h = |v: f32| half::bf16::from_f32(v).to_ne_bytes();
        let mut ours: Vec<u8> = [h(1.0), h(-2.0)].concat();
        max(&mut ours, &[h(f32::NAN), h(4.0)].concat()).unwrap();
        assert_eq!(ours, [h(1.0), h(4.0)].concat());
    }

    #[test]
    fn premul_sum_is_refused() {
        assert!(matches!(
            combine_with(ReduceOp::premul_sum(2.0), DType::F32),
            Err(CommError::Unsupported { .. })
        ));
    }
}
