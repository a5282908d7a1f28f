//! `consort store` and `consort run` with torch on the other side: a torch
//! client against the store, torchrun launching consort, torch workers
//! under consort run; and the store's secret, which torch's clients cannot
//! speak, so it is opt-in.
//!
//! The torch tests need a python with torch, named by
//! `CONSORT_TORCH_PYTHON=/path/to/python`; without it they print why they
//! skip and pass (the byte-exact transcript tests in consort-tcp cover the
//! store protocol without torch).

mod support;

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    time::Duration,
};

use serde_json::Value;
use support::{BIN, bench_worker, consort, finish, free_port, rank0_rows};

/// The python named by CONSORT_TORCH_PYTHON, or `None` after printing why
/// the test skips.
fn torch_python(test: &str) -> Option<String> {
    match std::env::var("CONSORT_TORCH_PYTHON") {
        Ok(p) if !p.is_empty() => Some(p),
        _ => {
            eprintln!(
                "skipped {test}: set CONSORT_TORCH_PYTHON to a python with torch installed to run it"
            );
            None
        }
    }
}

/// `consort store` with `flags` (and no `CONSORT_SECRET` of ours), and the
/// `host:port` it prints once it listens.
fn start_store(flags: &[&str]) -> (Child, String) {
    let mut server = Command::new(BIN)
        .arg("store")
        .args(flags)
        .env_remove("CONSORT_SECRET")
        .stdout(Stdio::piped())
        .spawn()
        .expect("start consort store");
    let mut line = String::new();
    BufReader::new(server.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line.trim().rsplit(' ').next().unwrap().to_string();
    (server, addr)
}

/// torch's own TCPStore client against `consort store`.
#[test]
fn torch_client_talks_to_consort_store() {
    let Some(python) = torch_python("torch_client_talks_to_consort_store") else {
        return;
    };
    let (mut server, addr) = start_store(&["--port", "0"]);
    let port = addr.rsplit(':').next().unwrap().to_string();
    let script = r#"
import sys, json, datetime
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=datetime.timedelta(seconds=20))
s.set("k", "v")
out = {"get": s.get("k").decode(), "add": s.add("n", 5), "add2": s.add("n", -2), "check": s.check(["k"]), "num_keys": s.num_keys()}
print(json.dumps(out))
"#;
    let out = finish(
        Command::new(python)
            .args(["-c", script, &port])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start python"),
        "python",
    );
    let _ = server.kill();
    let _ = server.wait();
    assert!(out.status.success(), "{out:?}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["get"], "v");
    assert_eq!(v["add"], 5);
    assert_eq!(v["add2"], 3);
    assert_eq!(v["check"], true);
    assert_eq!(v["num_keys"], 2);
}

/// Real torchrun launches consort workers (`--no-python`): they find the
/// world, and torchrun's agent store, through init_from_env.
#[test]
fn torchrun_launches_consort_bench() {
    let Some(python) = torch_python("torchrun_launches_consort_bench") else {
        return;
    };
    let port = free_port().to_string();
    let mut args = vec![
        "-m",
        "torch.distributed.run",
        "--no-python",
        "--nproc-per-node",
        "2",
        "--master-port",
        &port,
    ];
    args.extend(bench_worker().into_iter().skip(1));
    let out = finish(
        Command::new(python)
            .args(&args)
            .env("CONSORT_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start torchrun"),
        "torchrun",
    );
    assert!(out.status.success(), "{out:?}");
    let rows: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 6, "{out:?}");
    for r in rows {
        assert_eq!(r["world"], 2);
        assert_eq!(r["wrong"], 0, "{r}");
    }
}

/// A torch script written for torchrun (init_process_group("gloo") from
/// env://) runs unchanged under `consort run`, against its agent store.
#[test]
fn torch_workers_run_under_consort_run() {
    let Some(python) = torch_python("torch_workers_run_under_consort_run") else {
        return;
    };
    let script = r#"
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(3) * (dist.get_rank() + 1)
dist.all_reduce(t)
print("sum", t.tolist(), "world", dist.get_world_size(), "local", os.environ["LOCAL_RANK"])
dist.destroy_process_group()
"#;
    let out = finish(
        consort(&[
            "run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--",
            &python,
            "-c",
            script,
        ]),
        "consort run",
    );
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    for rank in 0..2 {
        assert!(
            stdout.contains(&format!(
                "[rank{rank}]: sum [3.0, 3.0, 3.0] world 2 local {rank}"
            )),
            "{stdout}"
        );
    }
}

/// `consort store --secret`: a client without the secret is refused, one
/// with it is served.
#[test]
fn consort_store_with_a_secret_refuses_clients_without_it() {
    use consort::store::Store;
    let flags = ["--port", "0", "--secret", "s3cret", "--max-clients", "8"];
    let (mut server, addr) = start_store(&flags);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (refused, served) = rt.block_on(async {
        let opts = |secret: Option<&str>| consort::TcpStoreOptions {
            timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            secret: secret.and_then(|s| consort::Secret::new(s.as_bytes())),
        };
        let without = match consort::TcpStore::connect(&addr, opts(None)).await {
            Ok(c) => c.set("k", b"v").await.is_err(),
            Err(_) => true,
        };
        let with = consort::TcpStore::connect(&addr, opts(Some("s3cret")))
            .await
            .expect("connect with the secret");
        with.set("k", b"v").await.unwrap();
        (without, with.get("k").await.unwrap())
    });
    let _ = server.kill();
    let _ = server.wait();
    assert!(refused, "a client without the secret was served");
    assert_eq!(served, b"v");
}

/// `consort run --secret auto`: the agent store and every worker's
/// connections take a random secret of the job (the workers get it as
/// CONSORT_SECRET) and the collectives still run; `auto` across nodes is
/// refused, since the other nodes could not know it.
#[test]
fn a_job_secret_protects_the_store_and_the_workers_use_it() {
    let mut args = vec![
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--secret",
        "auto",
    ];
    args.extend(bench_worker());
    let out = finish(consort(&args), "consort run --secret auto");
    assert!(out.status.success(), "{out:?}");
    let rows = rank0_rows(&out);
    assert!(
        !rows.is_empty() && rows.iter().all(|r| r["wrong"] == 0),
        "{out:?}"
    );
    let check = r#"[ ${#CONSORT_SECRET} -eq 48 ]"#;
    let out = finish(
        consort(&[
            "run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--secret",
            "auto",
            "--",
            "sh",
            "-c",
            check,
        ]),
        "consort run --secret auto -- sh",
    );
    assert!(
        out.status.success(),
        "the workers did not get the job's secret: {out:?}"
    );
    let out = finish(
        consort(&[
            "run",
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--secret",
            "auto",
            "--",
            "true",
        ]),
        "consort run --nnodes 2 --secret auto",
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--secret auto"),
        "{err}"
    );
}
