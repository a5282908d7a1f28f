//! The agent: one per node. Node 0's agent hosts the TCPStore as the
//! agent store; every agent meets the others there once per round, starts
//! its workers ([`super::round`]), and on a failure stops the round and
//! starts the next with `TORCHELASTIC_RESTART_COUNT + 1`, up to
//! `max_restarts` (torch's `SimpleElasticAgent`).

use std::{sync::Arc, time::Duration};

use consort_comm::store::Store;
use consort_tcp::{TcpStore, TcpStoreOptions, TcpStoreServer};
use tokio::signal::unix::{SignalKind, signal};

use super::{LaunchError, LaunchSpec, round::run_round, workers::Signals};

/// Runs the agent of this node until the job ends; returns the exit code
/// for the process: 0, or the failing worker's (128 + signal when killed).
pub async fn launch(spec: LaunchSpec) -> Result<i32, LaunchError> {
    spec.validate()?;
    let a = &spec;
    let program = &a.program;
    // Installed before any worker starts, so no signal slips past them.
    let mut signals = Signals {
        int: signal(SignalKind::interrupt())?,
        term: signal(SignalKind::terminate())?,
    };
    let addr = crate::env::host_port(&a.master_addr, a.master_port);
    let rdzv_timeout = Duration::from_secs_f64(a.rdzv_timeout);
    // Node 0 hosts the agent store (where init_from_env's rank 0 would).
    let server = if a.node_rank == 0 {
        let bind = crate::store_bind_addr(&a.master_addr, a.master_port).await;
        Some(
            TcpStoreServer::bind_opts(
                bind.as_str(),
                consort_tcp::ServerOptions::from_env()
                    .map_err(|e| LaunchError::Store(e.to_string()))?,
            )
            .await
            .map_err(|e| {
                LaunchError::Store(format!("{e} (or use --standalone for a free port)"))
            })?,
        )
    } else {
        None
    };
    let store: Arc<dyn Store> = Arc::new(
        TcpStore::connect(
            addr.clone(),
            TcpStoreOptions {
                connect_timeout: rdzv_timeout,
                timeout: rdzv_timeout.max(TcpStoreOptions::default().timeout),
                ..Default::default()
            },
        )
        .await
        .map_err(|e| {
            LaunchError::Store(format!(
                "node {} of the launcher cannot reach the agent store (--rdzv-timeout {}s): {e}. \
                 Start node 0 (it hosts the store) with the same --master-addr/--master-port",
                a.node_rank, a.rdzv_timeout
            ))
        })?,
    );
    let world = a.nnodes * a.local_world_size;
    if world > crate::MAX_WORLD_SIZE {
        return Err(LaunchError::Config(format!(
            "--nnodes {} x {} workers is a world of {world}, more than consort supports ({})",
            a.nnodes,
            a.local_world_size,
            crate::MAX_WORLD_SIZE
        )));
    }
    let ns = format!("consort/agent/{}", a.rdzv_id);
    let mut restart = 0u32;
    let code = loop {
        // Every node's agent meets the others for this round.
        let round = format!("{ns}/{restart}");
        store
            .set(&format!("{round}/node/{}", a.node_rank), b"1")
            .await?;
        let keys: Vec<String> = (0..a.nnodes).map(|n| format!("{round}/node/{n}")).collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        store
            .wait(&keys, rdzv_timeout)
            .await
            .map_err(|e| {
                LaunchError::Rendezvous(format!(
                    "rendezvous of {} nodes (round {restart}) failed: {e}. Start `consort run --node-rank N` \
                     on every node, with the same --nnodes, --master-addr, --master-port and --rdzv-id",
                    a.nnodes
                ))
            })?;

        let failure = run_round(a, program, &store, &round, restart, world, &mut signals).await?;
        match failure {
            None => break 0,
            Some(f) if restart < a.max_restarts => {
                eprintln!(
                    "[consort run] rank {} failed ({}); restarting the group (attempt {} of {}). \
                     Its last output:",
                    f.rank,
                    f.describe(),
                    restart + 1,
                    a.max_restarts
                );
                for l in &f.tail {
                    eprintln!("[consort run]   {l}");
                }
                restart += 1;
            }
            Some(f) => {
                eprintln!(
                    "[consort run] rank {} failed with {} after {} restart(s). Its last output:",
                    f.rank,
                    f.describe(),
                    restart
                );
                for l in &f.tail {
                    eprintln!("[consort run]   {l}");
                }
                break f.code();
            }
        }
    };
    // A failed job keeps its temporary directory: the summary names the
    // flight records in it.
    if a.log_dir.is_none() && code == 0 {
        let _ = std::fs::remove_dir_all(
            std::env::temp_dir().join(format!("consort-run-{}", std::process::id())),
        );
    }
    // Node 0 keeps the store up until every node has finished.
    store
        .set(&format!("{ns}/done/{}", a.node_rank), b"1")
        .await?;
    if let Some(server) = server {
        let keys: Vec<String> = (0..a.nnodes).map(|n| format!("{ns}/done/{n}")).collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        let _ = store.wait(&keys, Duration::from_secs(60)).await;
        drop(store);
        server.shutdown().await;
    }
    Ok(code)
}
