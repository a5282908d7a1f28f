//! `init_from_env` across real OS processes on loopback: the test binary
//! re-runs itself as the workers (the ignored `worker` test), each with its
//! own launcher variables, exactly as torchrun would start them.

use std::{
    collections::HashMap,
    process::{Child, Command, Output, Stdio},
    time::Duration,
};

use consort::{TcpStoreServer, store::Store};
use serde_json::Value;

/// The worker: joins the job, checks it can see every other rank through
/// the store, prints one JSON line, and leaves. Only runs as a child.
#[tokio::test]
#[ignore = "worker process for the other tests in this file"]
async fn worker() {
    if std::env::var("CONSORT_TEST_WORKER").is_err() {
        return;
    }
    let out = match consort::init_from_env().await {
        Err(e) => serde_json::json!({"error": e.to_string()}),
        Ok(dist) => {
            if std::env::var("CONSORT_TEST_GROUP").is_ok()
                && let Err(e) = dist.process_group().await
            {
                println!("WORKER {}", serde_json::json!({"error": e.to_string()}));
                dist.shutdown_failed(&[]).await;
                return;
            }
            let s = dist.store();
            let r = dist.rank();
            s.set(&format!("hello/{r}"), format!("from {r}").as_bytes())
                .await
                .unwrap();
            let total = s.add("sum", r as i64 + 1).await.unwrap();
            let keys: Vec<String> = (0..dist.world_size())
                .map(|i| format!("hello/{i}"))
                .collect();
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            let hellos: Vec<String> = s
                .multi_get(&keys)
                .await
                .unwrap()
                .into_iter()
                .map(|v| String::from_utf8(v).unwrap())
                .collect();
            let v = serde_json::json!({
                "rank": r,
                "world_size": dist.world_size(),
                "local_rank": dist.local_rank(),
                "hosts_store": dist.hosts_store(),
                "hellos": hellos,
                "my_add": total,
            });
            dist.shutdown().await.unwrap();
            v
        }
    };
    println!("WORKER {out}");
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts a worker with exactly `vars` as its launcher environment.
fn spawn(vars: &[(&str, String)]) -> Child {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args([
        "--ignored",
        "--exact",
        "worker",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("CONSORT_TEST_WORKER", "1")
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    for v in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_USE_AGENT_STORE",
        "TORCHELASTIC_RESTART_COUNT",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
        "CONSORT_STORE_TIMEOUT",
        "CONSORT_SHM_THREADS",
        "CONSORT_TEST_GROUP",
    ] {
        c.env_remove(v);
    }
    for (k, v) in vars {
        c.env(k, v);
    }
    c.spawn().expect("spawn worker")
}

fn result(out: Output) -> Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.split_once("WORKER ").map(|(_, json)| json))
        .unwrap_or_else(|| panic!("worker printed no result: {out:?}"));
    serde_json::from_str(line).unwrap()
}

fn torchrun_vars(
    rank: usize,
    world: usize,
    port: u16,
    timeout_s: &str,
) -> Vec<(&'static str, String)> {
    vec![
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("LOCAL_WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", port.to_string()),
        ("CONSORT_STORE_TIMEOUT", timeout_s.to_string()),
    ]
}

fn run_all(children: Vec<Child>) -> Vec<Value> {
    children
        .into_iter()
        .map(|c| result(c.wait_with_output().unwrap()))
        .collect()
}

#[test]
fn four_processes_meet_through_rank_zeros_store() {
    let port = free_port();
    // Start the non-zero ranks first: they retry until rank 0 is up.
    let mut children: Vec<Child> = (1..4)
        .map(|r| spawn(&torchrun_vars(r, 4, port, "60")))
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    children.insert(0, spawn(&torchrun_vars(0, 4, port, "60")));
    let results = run_all(children);
    let mut adds = Vec::new();
    for (r, v) in results.iter().enumerate() {
        assert!(v.get("error").is_none(), "rank {r}: {v}");
        assert_eq!(v["rank"], r);
        assert_eq!(v["world_size"], 4);
        assert_eq!(v["hosts_store"], r == 0);
        assert_eq!(
            v["hellos"],
            serde_json::json!(["from 0", "from 1", "from 2", "from 3"])
        );
        adds.push(v["my_add"].as_i64().unwrap());
    }
    adds.sort();
    assert_eq!(
        *adds.last().unwrap(),
        1 + 2 + 3 + 4,
        "every rank's add landed: {adds:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_use_the_agents_store_when_told_to() {
    let agent = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
    let port = agent.local_addr().port();
    let children: Vec<Child> = (0..2)
        .map(|r| {
            let mut v = torchrun_vars(r, 2, port, "60");
            v.push(("TORCHELASTIC_USE_AGENT_STORE", "True".into()));
            v.push(("TORCHELASTIC_RESTART_COUNT", "1".into()));
            spawn(&v)
        })
        .collect();
    let results = tokio::task::spawn_blocking(move || run_all(children))
        .await
        .unwrap();
    for v in &results {
        assert!(v.get("error").is_none(), "{v}");
        assert_eq!(v["hosts_store"], false, "the agent hosts the store");
    }
    // The workers' keys are in the agent's store, under torch's "/" prefix,
    // and the rendezvous used the restart round's namespace.
    let c = consort::TcpStore::connect(agent.local_addr().to_string(), Default::default())
        .await
        .unwrap();
    assert_eq!(c.get("hello/1").await.unwrap(), b"from 1");
    assert!(
        c.check(&["consort/rdzv/1/rank/0", "consort/rdzv/1/rank/1"])
            .await
            .unwrap()
    );
    agent.shutdown().await;
}

#[test]
fn a_missing_rank_times_out_naming_it() {
    let port = free_port();
    let children: Vec<Child> = [0, 1]
        .into_iter()
        .map(|r| spawn(&torchrun_vars(r, 3, port, "2")))
        .collect();
    let results = run_all(children);
    let errors: Vec<&str> = results
        .iter()
        .map(|v| {
            v["error"]
                .as_str()
                .unwrap_or_else(|| panic!("expected an error: {v}"))
        })
        .collect();
    // Rank 0 hosts the store and names the missing rank.
    assert!(
        errors[0].contains("waiting for 1 of 3 ranks to join (missing: [2])"),
        "{}",
        errors[0]
    );
    // Rank 1 names it too, or, if rank 0 gave up first and took the store
    // with it, says that the store went away.
    assert!(
        errors[1].contains("(missing: [2])") || errors[1].contains("closed the connection"),
        "{}",
        errors[1]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_with_one_rank_are_told_so() {
    let agent = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
    let port = agent.local_addr().port();
    let children: Vec<Child> = (0..2)
        .map(|_| {
            let mut v = torchrun_vars(1, 2, port, "2");
            v.push(("TORCHELASTIC_USE_AGENT_STORE", "True".into()));
            spawn(&v)
        })
        .collect();
    let results = tokio::task::spawn_blocking(move || run_all(children))
        .await
        .unwrap();
    let errors: Vec<&str> = results.iter().filter_map(|v| v["error"].as_str()).collect();
    assert_eq!(errors.len(), 2, "{results:?}");
    assert!(
        errors
            .iter()
            .any(|e| e.contains("rank 1 is claimed by two processes")),
        "{errors:?}"
    );
    agent.shutdown().await;
}

#[test]
fn no_launcher_is_a_world_of_one() {
    let v = result(spawn(&[]).wait_with_output().unwrap());
    assert_eq!(v["world_size"], 1);
    assert_eq!(v["rank"], 0);
    assert_eq!(v["hellos"], serde_json::json!(["from 0"]));
}

#[test]
fn bad_launcher_values_name_the_variable() {
    let cases: HashMap<&str, Vec<(&str, String)>> = HashMap::from([
        (
            "RANK=\"x\" is not valid",
            vec![("RANK", "x".into()), ("WORLD_SIZE", "2".into())],
        ),
        (
            "MASTER_ADDR is not set, but RANK is",
            vec![
                ("RANK", "0".into()),
                ("WORLD_SIZE", "2".into()),
                ("MASTER_PORT", "1".into()),
            ],
        ),
        (
            "CONSORT_STORE_TIMEOUT=\"soon\"",
            vec![("CONSORT_STORE_TIMEOUT", "soon".into())],
        ),
    ]);
    for (want, vars) in cases {
        let v = result(spawn(&vars).wait_with_output().unwrap());
        let e = v["error"]
            .as_str()
            .unwrap_or_else(|| panic!("expected an error: {v}"));
        assert!(e.contains(want), "got `{e}`, want `{want}`");
    }
}

/// A bad `CONSORT_SHM_THREADS` is an error on every rank, naming it, when
/// the rank makes its process group (before it meets the others there).
#[test]
fn a_bad_thread_count_names_the_variable_on_every_rank() {
    for (value, want) in [
        ("9", "CONSORT_SHM_THREADS=9 is not valid: expected 1 to 8"),
        ("0", "CONSORT_SHM_THREADS=\"0\" is not valid"),
    ] {
        let port = free_port();
        let children: Vec<Child> = (0..2)
            .map(|r| {
                let mut v = torchrun_vars(r, 2, port, "30");
                v.push(("CONSORT_SHM_THREADS", value.into()));
                v.push(("CONSORT_TEST_GROUP", "1".into()));
                spawn(&v)
            })
            .collect();
        for v in run_all(children) {
            let e = v["error"]
                .as_str()
                .unwrap_or_else(|| panic!("expected an error: {v}"));
            assert!(e.contains(want), "got `{e}`, want `{want}`");
        }
    }
}

#[test]
fn an_unreachable_master_is_a_clear_error() {
    let port = free_port();
    let r = result(
        spawn(&torchrun_vars(1, 2, port, "1"))
            .wait_with_output()
            .unwrap(),
    );
    let e = r["error"].as_str().unwrap();
    assert!(
        e.contains(&format!(
            "could not connect to the store at 127.0.0.1:{port}"
        )),
        "{e}"
    );
    assert!(e.contains("MASTER_ADDR"), "{e}");
}
