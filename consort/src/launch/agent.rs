//! The agent: one per node. One agent hosts the TCPStore as the agent
//! store (node 0, or under elastic membership the first to bind the
//! endpoint); every agent meets the others there before each round
//! ([`super::rendezvous`]), starts its workers ([`super::round`]), and
//! starts the next round when a worker fails (up to `max_restarts`
//! failures) or a new node waits to join (torch's `SimpleElasticAgent`).
//! Workers see `TORCHELASTIC_RESTART_COUNT` = the round's index.

use std::{sync::Arc, time::Duration};

use consort_comm::store::Store;
use consort_tcp::{TcpStore, TcpStoreOptions, TcpStoreServer};
use tokio::signal::unix::{SignalKind, signal};

use super::{
    LaunchError, LaunchSpec,
    rendezvous::{meet, round_key},
    round::{RoundEnd, run_round},
    workers::Signals,
};

/// Runs the agent of this node until the job ends; returns the exit code
/// for the process: 0, or the failing worker's (128 + signal when killed).
pub async fn launch(spec: LaunchSpec) -> Result<i32, LaunchError> {
    spec.validate()?;
    let a = &spec;
    // Installed before any worker starts, so no signal slips past them.
    let mut signals = Signals {
        int: signal(SignalKind::interrupt())?,
        term: signal(SignalKind::terminate())?,
    };
    warn_without_secret(a);
    let server = host_store(a).await?;
    let store = connect(a).await?;
    // Made once the store is up: a launch that fails before leaves none.
    let run_dir = super::dirs::run_dir(a.log_dir.as_deref())?;
    let ns = format!("consort/agent/{}", a.rdzv_id);
    let (mut round, mut failures) = (0u32, 0u32);
    // This node's place in the last round, and that round's size and key.
    let mut last: (usize, usize, String);
    let code = loop {
        let Some(m) = meet(a, &*store, &ns, round).await? else {
            round += 1;
            continue;
        };
        if m.world > crate::MAX_WORLD_SIZE {
            return Err(LaunchError::Config(format!(
                "{} nodes' workers make a world of {}, more than consort supports ({})",
                m.nnodes,
                m.world,
                crate::MAX_WORLD_SIZE
            )));
        }
        let key = round_key(&ns, round);
        last = (m.node_rank, m.nnodes, key.clone());
        match run_round(a, &m, &store, &ns, &key, (round, &run_dir), &mut signals).await? {
            RoundEnd::Done => break 0,
            RoundEnd::NewMember => {
                eprintln!(
                    "[consort run] a node waits to join: restarting the group with it (round {})",
                    round + 1
                );
            }
            RoundEnd::Failed(f) if failures < a.max_restarts => {
                failures += 1;
                eprintln!(
                    "[consort run] rank {} failed ({}); restarting the group (attempt {} of {}). \
                     Its last output:",
                    f.rank,
                    f.describe(),
                    failures,
                    a.max_restarts
                );
                for l in &f.tail {
                    eprintln!("[consort run]   {l}");
                }
            }
            RoundEnd::Failed(f) => {
                eprintln!(
                    "[consort run] rank {} failed with {} after {} restart(s). Its last output:",
                    f.rank,
                    f.describe(),
                    failures
                );
                for l in &f.tail {
                    eprintln!("[consort run]   {l}");
                }
                break f.code();
            }
        }
        round += 1;
    };
    // A failed job keeps its temporary directory: the summary names the
    // flight records in it.
    if a.log_dir.is_none() && code == 0 {
        let _ = std::fs::remove_dir_all(&run_dir);
    }
    // The store's host keeps it up until every node of the last round has
    // finished.
    let (node, nnodes, key) = last;
    store.set(&format!("{key}/done/{node}"), b"1").await?;
    if let Some(server) = server {
        let keys: Vec<String> = (0..nnodes).map(|n| format!("{key}/done/{n}")).collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        let _ = store.wait(&keys, Duration::from_secs(60)).await;
        drop(store);
        server.shutdown().await;
    }
    Ok(code)
}

/// The job's secret: `--secret`, else the agent's `CONSORT_SECRET`.
fn secret(a: &LaunchSpec) -> Option<consort_tcp::Secret> {
    match &a.secret {
        Some(s) => consort_tcp::Secret::new(s.as_bytes()),
        None => consort_tcp::Secret::from_env(),
    }
}

/// One line for a job across nodes without `CONSORT_SECRET`.
fn warn_without_secret(a: &LaunchSpec) {
    if a.max_nodes > 1 && secret(a).is_none() {
        eprintln!(
            "[consort run] warning: a job across nodes without CONSORT_SECRET: anyone who reaches \
             the store port can rewrite the rendezvous; set the same CONSORT_SECRET on every node \
             when every worker is consort (SECURITY.md)"
        );
    }
}

/// The agent store's server, when this agent hosts it: node 0 of a static
/// job, or under elastic membership the agent that binds the endpoint
/// first (the others find the port taken and connect to it).
async fn host_store(a: &LaunchSpec) -> Result<Option<TcpStoreServer>, LaunchError> {
    let elastic = a.min_nodes != a.max_nodes;
    if !elastic && a.node_rank != 0 {
        return Ok(None);
    }
    let bind = crate::store_bind_addr(&a.master_addr, a.master_port).await;
    let mut opts =
        consort_tcp::ServerOptions::from_env().map_err(|e| LaunchError::Store(e.to_string()))?;
    opts.secret = secret(a);
    match TcpStoreServer::bind_opts(bind.as_str(), opts).await {
        Ok(s) => Ok(Some(s)),
        Err(_) if elastic => Ok(None),
        Err(e) => Err(LaunchError::Store(format!(
            "{e} (or use --standalone for a free port)"
        ))),
    }
}

/// The agent store, as a client.
async fn connect(a: &LaunchSpec) -> Result<Arc<dyn Store>, LaunchError> {
    let addr = crate::env::host_port(&a.master_addr, a.master_port);
    let rdzv_timeout = Duration::from_secs_f64(a.rdzv_timeout);
    let store = TcpStore::connect(
        addr,
        TcpStoreOptions {
            connect_timeout: rdzv_timeout,
            timeout: rdzv_timeout.max(TcpStoreOptions::default().timeout),
            secret: secret(a),
        },
    )
    .await
    .map_err(|e| {
        LaunchError::Store(format!(
            "node {} of the launcher cannot reach the agent store (--rdzv-timeout {}s): {e}. \
             Start node 0 (it hosts the store) with the same --master-addr/--master-port",
            a.node_rank, a.rdzv_timeout
        ))
    })?;
    Ok(Arc::new(store))
}
