//! Interop with PyTorch's own TCPStore, in real Python processes.
//!
//! These need a Python with torch. They are `#[ignore]`d in the default run
//! so that `cargo test --workspace` works on a machine without torch; CI
//! installs torch and runs them with
//! `CONSORT_TORCH_PYTHON=/path/to/python cargo test -p consort-tcp --test
//! torch_interop -- --ignored`, where a missing interpreter is a failure.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    time::Duration,
};

use consort_comm::store::Store;
use consort_tcp::{TcpStore, TcpStoreOptions, TcpStoreServer};
use serde_json::Value;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/torch_store.py");

fn python() -> String {
    std::env::var("CONSORT_TORCH_PYTHON").expect(
        "set CONSORT_TORCH_PYTHON to a python that has torch installed \
         (e.g. python3 -m venv /tmp/torchenv && /tmp/torchenv/bin/pip install torch)",
    )
}

fn opts() -> TcpStoreOptions {
    TcpStoreOptions {
        timeout: Duration::from_secs(20),
        connect_timeout: Duration::from_secs(20),
        secret: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs torch: set CONSORT_TORCH_PYTHON and pass --ignored"]
async fn torch_client_uses_our_server() {
    let server = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
    let port = server.local_addr().port();
    let child = Command::new(python())
        .args([SCRIPT, "client", &port.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .expect("start python");
    let ours = TcpStore::connect(server.local_addr().to_string(), opts())
        .await
        .unwrap();
    ours.wait(&["t/torch_ready"], Duration::from_secs(60))
        .await
        .unwrap();
    // torch's keys are ours: same "/" prefix.
    assert_eq!(ours.get("t/alpha").await.unwrap(), b"two");
    assert_eq!(ours.get("t/n").await.unwrap(), b"3");
    ours.set("t/from_rust", b"hi from consort").await.unwrap();

    let out = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
        .await
        .unwrap();
    assert!(out.status.success(), "python failed: {out:?}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["get"], "one");
    assert_eq!(v["add1"], 5);
    assert_eq!(v["add2"], 3);
    assert_eq!(v["cas_ok"], "two");
    assert_eq!(v["cas_miss"], "two");
    assert_eq!(v["check"], true);
    assert_eq!(v["check_missing"], false);
    assert_eq!(v["multi_get"], serde_json::json!(["v1", "v2"]));
    assert_eq!(v["appended"], "v1+tail");
    assert_eq!(v["delete"], true);
    assert_eq!(v["delete_again"], false);
    assert_eq!(v["wait_timeout"], true);
    assert_eq!(v["after_timeout"], "two");
    assert_eq!(v["queue_len"], 2);
    assert_eq!(v["queue_pop"], serde_json::json!(["q1", "q2"]));
    assert_eq!(v["queue_empty"], true);
    let keys: Vec<String> = serde_json::from_value(v["list_keys"].clone()).unwrap();
    assert_eq!(v["num_keys"], keys.len());
    assert!(keys.contains(&"t/alpha".to_string()), "{keys:?}");
    assert!(!keys.iter().any(|k| k == "t/q"), "a queue listed: {keys:?}");
    assert_eq!(v["barrier_timeout"], true);
    assert_eq!(v["after_barrier"], "1");
    assert_eq!(v["from_rust"], "hi from consort");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs torch: set CONSORT_TORCH_PYTHON and pass --ignored"]
async fn our_client_uses_torch_server() {
    let mut child = Command::new(python())
        .args([SCRIPT, "server"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("start python");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let port: u16 = lines.next().unwrap().unwrap().trim().parse().unwrap();
    let c = TcpStore::connect(format!("127.0.0.1:{port}"), opts())
        .await
        .unwrap();
    assert_eq!(c.add("r/n", 41).await.unwrap(), 41);
    assert_eq!(c.add("r/n", 1).await.unwrap(), 42);
    assert_eq!(c.compare_set("r/cas", b"", b"a").await.unwrap(), b"a");
    assert_eq!(c.compare_set("r/cas", b"zz", b"b").await.unwrap(), b"a");
    c.multi_set(&["r/m1", "r/m2"], &[b"x", b"y"]).await.unwrap();
    assert_eq!(
        c.multi_get(&["r/m2", "r/m1"]).await.unwrap(),
        vec![b"y".to_vec(), b"x".to_vec()]
    );
    assert!(c.check(&["r/m1"]).await.unwrap());
    assert!(!c.check(&["r/nothing"]).await.unwrap());
    assert!(
        c.wait(&["r/nothing"], Duration::from_millis(200))
            .await
            .is_err()
    );
    assert!(c.delete_key("r/m1").await.unwrap());
    // torch's queue ops (TCPStore.queue_push / queue_pop / queue_len).
    c.queue_push("r/q", b"first").await.unwrap();
    c.queue_push("r/q", b"second").await.unwrap();
    assert_eq!(c.queue_len("r/q").await.unwrap(), 2);
    assert_eq!(c.queue_pop("r/q", true).await.unwrap(), b"first");
    assert_eq!(c.queue_pop("r/q", false).await.unwrap(), b"second");
    assert!(matches!(
        c.queue_pop("r/q", false).await,
        Err(consort_comm::store::StoreError::QueueEmpty { .. })
    ));
    c.set("r/from_rust", b"hello from consort").await.unwrap();
    let reply: Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    assert_eq!(reply["from_rust"], "hello from consort");
    assert_eq!(reply["counter"], "42");
    assert_eq!(c.get("r/from_torch").await.unwrap(), b"hello from torch");
    let keys = c.list_keys().await.unwrap();
    assert!(keys.contains(&"r/from_rust".to_string()), "{keys:?}");
    c.barrier("r/bar", 2, Duration::from_secs(20))
        .await
        .unwrap();
    c.set("r/done", b"1").await.unwrap();
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    assert!(status.success());
}

/// Runs the helper script with `args` and parses the last line it prints.
async fn torch_json(args: Vec<String>) -> Value {
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python())
            .arg(SCRIPT)
            .args(&args)
            .output()
            .expect("start python")
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(line.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("python printed {line:?}: {e}"))
}

/// torch 2.15's whole client API from two torch clients (threads for the
/// calls that block): barriers of one and of two, a barrier that times out
/// and retries, queue_push, queue_pop with and without block (and one
/// woken by the other client's push), queue_len, list_keys, num_keys,
/// multi_get, multi_set, compare_set, append, delete_key, check and wait.
/// Against our server and against torch's own, the answers are the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs torch: set CONSORT_TORCH_PYTHON and pass --ignored"]
async fn torch_client_api_answers_as_on_torchs_server() {
    let server = TcpStoreServer::bind("127.0.0.1:0").await.unwrap();
    let port = server.local_addr().port();
    let ours = torch_json(vec!["api".into(), port.to_string()]).await;
    let torchs = torch_json(vec!["api-master".into()]).await;
    for (k, want) in torchs.as_object().unwrap() {
        assert_eq!(&ours[k], want, "{k}: ours, then torch's server's");
    }
    assert_eq!(ours, torchs);
    // What they agree on, spelled out.
    assert_eq!(ours["blocking_pop"], serde_json::json!([true, "late"]));
    assert_eq!(ours["barrier"], serde_json::json!(["1", true, true, "2"]));
    assert_eq!(ours["barrier_retry"], serde_json::json!([true, "1", "3"]));
    server.shutdown().await;
}

/// A torch client on a store that another client filled to its limit and
/// left: it connects (VALIDATE and PING), reads what was set before,
/// CHECKs, deletes four 1 MiB values and then writes 1 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs torch: set CONSORT_TORCH_PYTHON and pass --ignored"]
async fn a_torch_client_is_served_by_a_store_filled_to_its_limit() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let server = TcpStoreServer::bind_opts(
        "127.0.0.1:0",
        consort_tcp::ServerOptions {
            max_bytes: 16 << 20,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let addr = server.local_addr();
    let ours = TcpStore::connect(addr.to_string(), opts()).await.unwrap();
    ours.set("before", b"precious").await.unwrap();
    assert!(ours.check(&["before"]).await.unwrap());
    // Values of 1 MiB, 4 KiB, then none, each size until the server closes
    // the filler's connection; a PING after each batch shows it stored.
    for (size, batch) in [(1usize << 20, 2usize), (4096, 64), (0, 1024)] {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut hello = vec![0u8];
        hello.extend_from_slice(&consort_tcp::store::VALIDATION_MAGIC.to_le_bytes());
        s.write_all(&hello).await.unwrap();
        for round in 0..100_000 {
            let mut b = Vec::new();
            for i in 0..batch {
                let key = format!("/fill-{size}-{}", round * batch + i);
                b.push(1);
                b.extend_from_slice(&(key.len() as u64).to_le_bytes());
                b.extend_from_slice(key.as_bytes());
                b.extend_from_slice(&(size as u64).to_le_bytes());
                b.extend_from_slice(&vec![5u8; size]);
            }
            b.extend_from_slice(&[13, 7, 0, 0, 0]);
            let mut echo = [0u8; 4];
            let sent = async {
                s.write_all(&b).await?;
                s.read_exact(&mut echo).await
            };
            if !matches!(
                tokio::time::timeout(Duration::from_secs(10), sent).await,
                Ok(Ok(_))
            ) {
                break;
            }
        }
    }
    let v = torch_json(vec!["full".into(), addr.port().to_string()]).await;
    eprintln!(
        "torch's client connected in {} ms, all done in {} ms",
        v["connect_ms"], v["ms"]
    );
    assert_eq!(v["before"], "precious");
    assert_eq!(v["check"], true);
    assert_eq!(v["deleted"], serde_json::json!([true, true, true, true]));
    assert_eq!(v["after"], 1 << 20);
    server.shutdown().await;
}
