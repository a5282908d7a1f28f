//! The `consort` binary as a user runs it.

use std::process::Command;

use serde_json::Value;

fn consort(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_consort"))
        .args(args)
        .output()
        .expect("run consort")
}

#[test]
fn sampler_prints_one_ranks_indices_as_json() {
    let out = consort(&[
        "sampler",
        "--len",
        "10",
        "--num-replicas",
        "3",
        "--rank",
        "1",
        "--seed",
        "0",
        "--epoch",
        "0",
        "--shuffle",
        "true",
        "--drop-last",
        "false",
    ]);
    assert!(out.status.success(), "{out:?}");
    // torch 2.15: list(DistributedSampler(range(10), 3, 1, shuffle=True, seed=0))
    assert_eq!(String::from_utf8(out.stdout).unwrap().trim(), "[1,3,8,4]");
    let out = consort(&[
        "sampler",
        "--len",
        "100",
        "--num-replicas",
        "4",
        "--rank",
        "2",
        "--mode",
        "streaming",
    ]);
    let v: Vec<u64> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v.len(), 25);
}

#[test]
fn sampler_refuses_a_bad_rank_clearly() {
    let out = consort(&[
        "sampler",
        "--len",
        "10",
        "--num-replicas",
        "3",
        "--rank",
        "3",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("rank 3 is out of range for num_replicas 3"),
        "{err}"
    );
}

#[test]
fn sim_json_rows_carry_the_documented_fields() {
    let out = consort(&[
        "sim",
        "--op",
        "all_reduce",
        "--algo",
        "ring",
        "--world-size",
        "16",
        "--sizes",
        "4K,1M",
        "--json",
    ]);
    assert!(out.status.success(), "{out:?}");
    let rows: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2);
    for f in [
        "op",
        "algo",
        "world",
        "bytes",
        "time_us",
        "algbw_gbs",
        "busbw_gbs",
        "closed_form_us",
    ] {
        assert!(rows[0].get(f).is_some(), "missing {f}: {}", rows[0]);
    }
    assert_eq!(rows[1]["bytes"], 1 << 20);
}

#[test]
fn version_and_help() {
    let v: Value = serde_json::from_slice(&consort(&["version", "--json"]).stdout).unwrap();
    assert_eq!(v["name"], "consort");
    let help = String::from_utf8(consort(&["--help"]).stdout).unwrap();
    for sub in ["version", "store", "bench", "sim", "sampler"] {
        assert!(help.contains(sub), "{help}");
    }
}

/// Without the `nccl` feature, or without libnccl, libcuda or a GPU, the
/// NCCL bench says so and what to do; it never panics or starts workers
/// that hang.
#[test]
fn bench_nccl_without_a_gpu_is_backend_unavailable() {
    let out = consort(&[
        "bench",
        "--backend",
        "nccl",
        "--world-size",
        "2",
        "--sizes",
        "4K",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        eprintln!(
            "this machine ran the NCCL bench: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        return;
    }
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("backend `nccl` is unavailable"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// The bench's checker is exact past world 8 (it used to wrap the expected
/// sum mod 64 and report false `#wrong`), in every dtype family.
#[test]
fn bench_checker_is_exact_at_world_nine() {
    for dtype in ["f32", "bf16", "i8", "u64"] {
        let out = consort(&[
            "bench",
            "--backend",
            "sim",
            "--world-size",
            "9",
            "--sizes",
            "4K",
            "--iters",
            "1",
            "--dtype",
            dtype,
            "--json",
        ]);
        assert!(out.status.success(), "{out:?}");
        let rows: Vec<Value> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.starts_with('{'))
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(rows.len(), 5, "{dtype}: one row per op");
        for r in rows {
            assert_eq!(r["wrong"], 0, "{dtype}: {r}");
        }
    }
}

/// `--timing`: the slowest rank's time per iteration by default (as the
/// anchors and nccl-tests), rank 0's on request; anything else is refused.
#[test]
fn bench_times_the_slowest_rank_unless_asked_for_rank0() {
    for timing in ["max", "rank0"] {
        let out = consort(&[
            "bench",
            "--backend",
            "tcp",
            "--world-size",
            "3",
            "--ops",
            "broadcast",
            "--sizes",
            "4K",
            "--iters",
            "5",
            "--timing",
            timing,
            "--json",
        ]);
        assert!(out.status.success(), "{timing}: {out:?}");
        let row: Value = String::from_utf8_lossy(&out.stdout)
            .lines()
            .find(|l| l.starts_with('{'))
            .map(|l| serde_json::from_str(l).unwrap())
            .expect("a row");
        assert!(row["time_us"].as_f64().unwrap() > 0.0, "{timing}: {row}");
        assert_eq!(row["wrong"], 0);
    }
    let out = consort(&["bench", "--timing", "mean"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("max") && err.contains("rank0"), "{err}");
}

/// Runs `consort` with extra environment variables.
fn consort_env(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_consort"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run consort")
}

/// Arguments, environment, and what the error must name.
type Case<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>, &'a str);

/// Every bad duration, count and size that used to panic (or allocate
/// until the machine ran out of memory) is refused with a message naming
/// it.
#[test]
fn bad_durations_counts_and_sizes_are_refused_not_panicked() {
    let bench = [
        "bench",
        "--backend",
        "tcp",
        "--world-size",
        "2",
        "--sizes",
        "4K",
        "--iters",
        "1",
    ];
    let from_env = ["bench", "--from-env", "--sizes", "4K", "--iters", "1"];
    let rank0 = [
        ("RANK", "0"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "1"),
    ];
    let cases: Vec<Case<'_>> = vec![
        (
            bench.to_vec(),
            vec![("CONSORT_TIMEOUT", "1e19")],
            "CONSORT_TIMEOUT",
        ),
        (
            bench.to_vec(),
            vec![("CONSORT_TIMEOUT", "NaN")],
            "CONSORT_TIMEOUT",
        ),
        (vec!["bench", "--iters", "0"], vec![], "--iters"),
        (
            vec!["bench", "sim-all-reduce", "--iters", "0"],
            vec![],
            "--iters",
        ),
        (
            vec!["bench", "--world-size", "100000"],
            vec![],
            "--world-size 100000",
        ),
        (
            vec!["run", "--grace-period", "1e20", "--", "true"],
            vec![],
            "--grace-period",
        ),
        (
            vec!["run", "--rdzv-timeout", "1e300", "--", "true"],
            vec![],
            "--rdzv-timeout",
        ),
        (
            vec!["run", "--monitor-interval", "inf", "--", "true"],
            vec![],
            "--monitor-interval",
        ),
        (
            vec!["run", "--nproc-per-node", "100000", "--", "true"],
            vec![],
            "--nproc-per-node",
        ),
        (
            vec!["run", "--nnodes", "99999999999", "--", "true"],
            vec![],
            "--nnodes",
        ),
        (
            from_env.to_vec(),
            [
                &rank0[..],
                &[("WORLD_SIZE", "2"), ("CONSORT_STORE_TIMEOUT", "1e30")],
            ]
            .concat(),
            "CONSORT_STORE_TIMEOUT",
        ),
        (
            from_env.to_vec(),
            [&rank0[..], &[("WORLD_SIZE", "1000000000")]].concat(),
            "more than consort supports",
        ),
        (
            from_env.to_vec(),
            [
                &rank0[..],
                &[
                    ("WORLD_SIZE", "8000"),
                    ("LOCAL_RANK", "0"),
                    ("LOCAL_WORLD_SIZE", "5000"),
                ],
            ]
            .concat(),
            "more than one host can hold",
        ),
    ];
    assert_refused(cases);
}

/// `consort store`'s limits, as flags or variables: refused with a message
/// naming them.
#[test]
fn bad_store_limits_are_refused() {
    let cases: Vec<Case<'_>> = vec![
        (
            vec!["store", "--port", "0", "--max-bytes", "lots"],
            vec![],
            "--max-bytes",
        ),
        (
            vec!["store", "--port", "0", "--max-clients", "0"],
            vec![],
            "--max-clients",
        ),
        (
            vec!["store", "--port", "0"],
            vec![("CONSORT_STORE_MAX_CLIENTS", "-3")],
            "CONSORT_STORE_MAX_CLIENTS",
        ),
        (
            vec!["store", "--port", "0"],
            vec![("CONSORT_STORE_MAX_BYTES", "1.5G")],
            "CONSORT_STORE_MAX_BYTES",
        ),
    ];
    assert_refused(cases);
}

/// Each case fails, without a panic, with an error naming what was wrong.
fn assert_refused(cases: Vec<Case<'_>>) {
    for (args, env, named) in cases {
        let out = consort_env(&args, &env);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} {env:?} succeeded");
        assert!(
            !err.contains("panicked"),
            "{args:?} {env:?} panicked: {err}"
        );
        assert!(
            err.contains(named),
            "{args:?} {env:?}: the error should name {named}: {err}"
        );
    }
}

/// `consort bench sharded`: every strategy's measured bytes are the ZeRO
/// formula's, up to the padding of each layer's flat buffer to a multiple
/// of the shard count (uneven layers here), and sharding never keeps more
/// than DDP.
#[test]
fn bench_sharded_bytes_match_the_formulas() {
    let out = consort(&[
        "bench", "sharded", "--params", "10001", "--layers", "3", "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let rows: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON row"))
        .collect();
    assert_eq!(rows.len(), 4 + 4 + 5 + 5, "{text}");
    for r in &rows {
        let world = r["world"].as_u64().unwrap() as usize;
        // At most shards-1 padding elements (4 bytes) per layer, and AdamW
        // keeps two slots.
        let pad = 3 * 4 * (world - 1);
        for (k, slack) in [("params", pad), ("grads", pad), ("optim", 2 * pad)] {
            let got = r[format!("{k}_bytes")].as_u64().unwrap() as usize;
            let want = r[format!("{k}_formula")].as_u64().unwrap() as usize;
            assert!(got >= want && got <= want + slack, "{k}: {r}");
        }
        let ratio: f64 = r["total_vs_ddp"].as_str().unwrap().parse().unwrap();
        assert!(ratio <= 1.0 + 1e-3, "{r}");
        if r["strategy"] == "fsdp" && world == 8 {
            assert!(ratio < 0.2, "FSDP at 8 keeps {ratio} of DDP's bytes: {r}");
        }
    }
}

/// `consort bench sharded --device emulated` in a launched job: every
/// strategy steps with the model on the (emulated) device, and the device
/// holds what the strategy keeps: for a model of psi bytes at world 2,
/// ZeRO-1 3 psi (whole parameters and gradients, half of AdamW's two
/// slots), ZeRO-2 2.5 psi, FSDP 2 psi; DDP 5 psi (the model, its unused
/// gradient storage, the buckets and AdamW's slots). With `--mixed bf16`
/// the same (f32 masters between steps), the rows named `zero1+bf16`...
#[test]
fn bench_sharded_on_the_emulated_device_holds_the_zero_formulas() {
    let psi = 64_000.0 * 4.0 / f64::from(1u32 << 20);
    let want = [("ddp", 5.0), ("zero1", 3.0), ("zero2", 2.5), ("fsdp", 2.0)];
    // Mixed precision keeps f32 masters: the same bytes between steps.
    for mixed in ["none", "bf16"] {
        let rows = emulated_bench(mixed);
        assert_eq!(rows.len(), want.len(), "{rows:?}");
        for (r, (name, times)) in rows.iter().zip(want) {
            let name = match (mixed, name) {
                ("none", n) | (_, n @ "ddp") => n.to_string(),
                (m, n) => format!("{n}+{m}"),
            };
            assert_eq!(r["strategy"], name.as_str(), "{r}");
            assert_eq!(r["device"], "emulated", "{r}");
            let mib: f64 = r["mem_mib"].as_str().unwrap().parse().unwrap();
            assert!(
                (mib - times * psi).abs() < 0.06,
                "{name}: {mib} MiB, want {times} psi: {r}"
            );
            let ms: f64 = r["step_ms"].as_str().unwrap().parse().unwrap();
            assert!(ms > 0.0, "{r}");
        }
    }
}

/// Rank 0's rows of `consort bench sharded --device emulated` on 2 ranks.
fn emulated_bench(mixed: &str) -> Vec<serde_json::Value> {
    emulated_rows(&["sharded", "--mixed", mixed])
}

/// Rank 0's JSON rows of `consort bench BENCH... --device emulated` (64K
/// parameters in 4 layers, 2 timed steps) on 2 launched ranks.
fn emulated_rows(bench: &[&str]) -> Vec<serde_json::Value> {
    let mut args = vec!["run", "--standalone", "--nproc-per-node", "2", "--"];
    args.extend([env!("CARGO_BIN_EXE_consort"), "bench"]);
    args.extend(bench);
    args.extend(["--device", "emulated", "--params", "64K", "--layers", "4"]);
    args.extend(["--iters", "2", "--json"]);
    let out = consort(&args);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .filter_map(|l| l.split_once('{').map(|(_, r)| format!("{{{r}")))
        .map(|l| serde_json::from_str(&l).expect("a JSON row"))
        .collect()
}

/// `consort bench ddp --device emulated` in a launched job: the three
/// device modes, and DDP's device buckets beside the model (params and
/// gradients 2 psi, buckets 1 psi).
#[test]
fn bench_ddp_on_the_emulated_device_times_each_mode() {
    let rows = emulated_rows(&["ddp"]);
    let text = format!("{rows:?}");
    let modes: Vec<&str> = rows.iter().map(|r| r["mode"].as_str().unwrap()).collect();
    assert_eq!(modes, ["local", "comm_only", "ddp_bucket_view"], "{text}");
    let psi = 64_000.0 * 4.0 / f64::from(1u32 << 20);
    let mib: f64 = rows[2]["mem_mib"].as_str().unwrap().parse().unwrap();
    assert!(
        (mib - 3.0 * psi).abs() < 0.06,
        "ddp holds {mib} MiB: {text}"
    );
}
