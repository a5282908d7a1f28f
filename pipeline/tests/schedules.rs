//! Our schedules against torch's: `golden/torch_orders.json` holds, for a
//! grid of (schedule, pipeline ranks 1-4, microbatches 1-8, stages per rank
//! 1 or 2-3), the action order torch 2.15 runs on every rank, or torch's
//! refusal; `scripts/torch_pipeline_orders.py` made it. Ours must equal it
//! slot for slot, and refuse exactly what torch refuses.
//!
//! `torch_still_agrees` reruns that script against the installed torch
//! (`CONSORT_TORCH_PYTHON`, set in CI) and requires the same file, so a
//! torch release that changes a schedule is seen.

use consort_pipeline::{Schedule, ScheduleKind};
use serde_json::Value;

const GOLDEN: &str = include_str!("golden/torch_orders.json");

fn ours(kind: ScheduleKind, pp: usize, m: usize, spr: usize) -> Result<Vec<Vec<Value>>, String> {
    let s = Schedule::new(kind, pp, m, spr).map_err(|e| e.to_string())?;
    Ok((0..pp)
        .map(|r| {
            s.order(r)
                .iter()
                .filter(|slot| slot.is_some() || !kind.single_stage())
                .map(|slot| slot.map_or(Value::Null, |st| Value::String(st.to_string())))
                .collect()
        })
        .collect())
}

#[test]
fn every_schedule_equals_torchs_order_on_every_rank() {
    let rows: Vec<Value> = serde_json::from_str(GOLDEN).unwrap();
    assert_eq!(rows.len(), 384);
    let mut compared = std::collections::HashMap::new();
    for row in &rows {
        let name = row["schedule"].as_str().unwrap();
        let kind: ScheduleKind = name.parse().unwrap();
        let n = |k: &str| row[k].as_u64().unwrap() as usize;
        let (pp, m, spr) = (n("pp"), n("microbatches"), n("stages_per_rank"));
        let got = ours(kind, pp, m, spr);
        match (row.get("error"), got) {
            (Some(e), Ok(_)) => {
                panic!("{name} pp={pp} m={m} spr={spr}: torch refuses ({e}), we do not")
            }
            (None, Err(e)) => {
                panic!("{name} pp={pp} m={m} spr={spr}: we refuse ({e}), torch does not")
            }
            (Some(_), Err(_)) => {}
            (None, Ok(got)) => {
                let want: Vec<Vec<Value>> = serde_json::from_value(row["orders"].clone()).unwrap();
                for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g, w, "{name} pp={pp} m={m} spr={spr} rank {r}");
                }
                assert_eq!(got.len(), want.len());
                *compared.entry(name).or_insert(0) += 1;
            }
        }
    }
    // Every schedule was compared on real orders, not only refusals.
    for k in ScheduleKind::ALL {
        assert!(
            compared.get(k.name()).copied().unwrap_or(0) >= 16,
            "{k}: {compared:?}"
        );
    }
}

#[test]
fn torch_still_agrees() {
    let Ok(python) = std::env::var("CONSORT_TORCH_PYTHON") else {
        eprintln!("skipped: set CONSORT_TORCH_PYTHON to a python with torch (CI does)");
        return;
    };
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../scripts/torch_pipeline_orders.py"
    );
    let out = std::process::Command::new(python)
        .arg(script)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let now: Value = serde_json::from_slice(&out.stdout).unwrap();
    let golden: Value = serde_json::from_str(GOLDEN).unwrap();
    assert_eq!(
        now, golden,
        "the installed torch's schedules differ from the golden file"
    );
}
