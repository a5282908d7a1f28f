//! The TCP backend across real OS processes on loopback: the test binary
//! re-runs itself as the workers, each launched with torchrun's variables.
//! Every world runs the conformance battery; one test kills a rank in the
//! middle of an all_reduce and times how fast the survivors notice.

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use consort::ReduceOp;
use serde_json::{Value, json};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The worker: joins, builds the TCP process group, runs `CONSORT_TEST_MODE`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "worker process for the other tests in this file"]
async fn worker() {
    let Ok(mode) = std::env::var("CONSORT_TEST_MODE") else {
        return;
    };
    let dist = consort::init_from_env().await.expect("init");
    let pg = match std::env::var("CONSORT_TEST_BACKEND").as_deref() {
        Ok("quic") => dist.quic_process_group().await.expect("QUIC process group"),
        _ => dist.process_group().await.expect("process group"),
    };
    match mode.as_str() {
        "battery" => {
            let results = consort_tests::checks::battery(pg.clone(), 42).await;
            let failures: Vec<String> = results
                .into_iter()
                .filter_map(|(name, o)| o.err().map(|e| format!("{name}: {e}")))
                .collect();
            println!(
                "WORKER {}",
                json!({"rank": pg.rank(), "failures": failures})
            );
        }
        "loop" => {
            let mut x = vec![1.0f32; 4 << 20];
            println!("WORKER {}", json!({"rank": pg.rank(), "started": true}));
            let err = loop {
                if let Err(e) = pg.all_reduce(&mut x, ReduceOp::Avg).await {
                    break e;
                }
            };
            println!(
                "WORKER {}",
                json!({"rank": pg.rank(), "error": err.to_string(), "kind": format!("{err:?}").split([' ', '{', '(']).next().unwrap_or("")})
            );
            // Drop the group before exiting, as returning from main would:
            // over QUIC that delivers this rank's abort frames to the others
            // (QUIC data dies with the process), so they learn of the failure
            // now instead of each waiting out an idle timeout in turn.
            drop(pg);
            std::process::exit(0);
        }
        other => panic!("unknown mode {other}"),
    }
    drop(pg);
    dist.shutdown().await.expect("shutdown");
}

fn spawn_on(
    backend: &str,
    rank: usize,
    world: usize,
    port: u16,
    mode: &str,
    timeout_s: u32,
    shm: bool,
) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .env("CONSORT_TEST_BACKEND", backend)
        .env("CONSORT_QUIC_IDLE_TIMEOUT", "2")
        .env("CONSORT_SHM", if shm { "1" } else { "0" })
        .args([
            "--ignored",
            "--exact",
            "worker",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("CONSORT_TEST_MODE", mode)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("CONSORT_TIMEOUT", timeout_s.to_string())
        .env("CONSORT_STORE_TIMEOUT", "60")
        .env_remove("TORCHELASTIC_USE_AGENT_STORE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn worker")
}

fn lines_of(child: &mut Child) -> std::sync::mpsc::Receiver<Value> {
    let (tx, rx) = std::sync::mpsc::channel();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if let Some((_, j)) = line.split_once("WORKER ") {
                let _ = tx.send(serde_json::from_str(j).unwrap());
            }
        }
    });
    rx
}

fn battery(world: usize) {
    battery_with(world, true);
}

fn battery_with(world: usize, shm: bool) {
    battery_on("tcp", world, shm);
}

fn battery_on(backend: &str, world: usize, shm: bool) {
    let port = free_port();
    let mut children: Vec<Child> = (0..world)
        .map(|r| spawn_on(backend, r, world, port, "battery", 60, shm))
        .collect();
    let rxs: Vec<_> = children.iter_mut().map(lines_of).collect();
    for (r, rx) in rxs.iter().enumerate() {
        let v = rx
            .recv_timeout(Duration::from_secs(300))
            .unwrap_or_else(|_| panic!("rank {r} printed nothing"));
        assert_eq!(v["rank"], r);
        assert_eq!(v["failures"], json!([]), "rank {r} of {world}");
    }
    for (r, mut c) in children.into_iter().enumerate() {
        let status = c.wait().unwrap();
        assert!(status.success(), "rank {r} of {world} exited with {status}");
    }
}

#[test]
fn conformance_battery_across_2_processes() {
    battery(2);
}

#[test]
fn conformance_battery_across_3_processes() {
    battery(3);
}

#[test]
fn conformance_battery_across_4_processes() {
    battery(4);
}

#[test]
fn conformance_battery_across_8_processes() {
    battery(8);
}

#[test]
fn conformance_battery_across_3_processes_without_shared_memory() {
    battery_with(3, false);
}

#[test]
fn a_killed_rank_is_noticed_within_2_seconds_without_shared_memory() {
    killed(false);
}

#[test]
fn a_killed_rank_is_noticed_by_every_survivor_within_2_seconds() {
    killed(true);
}

fn killed(shm: bool) {
    killed_on("tcp", shm, Duration::from_secs(2));
}

/// QUIC over UDP gets no reset from a dead peer's kernel: the victim's
/// neighbours notice when the idle timeout (2 s here, keep-alives every 2/3
/// s) passes, and their abort frames tell the rest. The bound leaves room
/// for a loaded CI machine.
#[cfg(feature = "quic")]
#[test]
fn a_killed_rank_is_noticed_over_quic_within_the_idle_timeout() {
    killed_on("quic", false, Duration::from_secs(8));
}

#[cfg(feature = "quic")]
#[test]
fn conformance_battery_across_3_processes_over_quic() {
    battery_on("quic", 3, false);
}

/// `Dist::quic_process_group` with `CONSORT_SHM=1`: the ranks on one host
/// meet through shared memory, as over TCP.
#[cfg(feature = "quic")]
#[test]
fn conformance_battery_across_3_processes_over_quic_with_shared_memory() {
    battery_on("quic", 3, true);
}

fn killed_on(backend: &str, shm: bool, bound: Duration) {
    let world = 4;
    let port = free_port();
    let mut children: Vec<Child> = (0..world)
        .map(|r| spawn_on(backend, r, world, port, "loop", 30, shm))
        .collect();
    let rxs: Vec<_> = children.iter_mut().map(lines_of).collect();
    for rx in &rxs {
        let v = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("worker started");
        assert_eq!(v["started"], true);
    }
    std::thread::sleep(Duration::from_millis(500));
    let victim = 2;
    children[victim].kill().expect("kill");
    let killed_at = Instant::now();
    for (r, rx) in rxs.iter().enumerate() {
        if r == victim {
            continue;
        }
        let v = rx
            .recv_timeout(Duration::from_secs(10))
            .unwrap_or_else(|_| panic!("rank {r} hung after the kill"));
        let noticed = killed_at.elapsed();
        let kind = v["kind"].as_str().unwrap();
        assert!(kind == "PeerLost" || kind == "Timeout", "rank {r}: {v}");
        assert!(noticed < bound, "rank {r} took {noticed:?}: {v}");
        eprintln!("rank {r} noticed after {noticed:?}: {}", v["error"]);
    }
    for (r, mut c) in children.into_iter().enumerate() {
        let status = c.wait().unwrap();
        if r != victim {
            assert!(status.success(), "rank {r}: {status}");
        }
    }
}
