//! Every case torch 2.15 produced (`fixtures/sampler_torch.json`) must
//! match exactly: 120 DistributedSampler cases and 19 randperm cases.

use consort_sampler::{DistributedSampler, randperm};
use serde_json::Value;

const GOLDEN: &str = include_str!("fixtures/sampler_torch.json");

fn golden() -> Value {
    serde_json::from_str(GOLDEN).unwrap()
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap()
}

#[test]
fn every_randperm_case_matches_torch() {
    let g = golden();
    let cases = g["randperm"].as_array().unwrap();
    assert_eq!(cases.len(), 19);
    for c in cases {
        let want: Vec<u64> = c["perm"].as_array().unwrap().iter().map(u).collect();
        let got = randperm(u(&c["n"]) as usize, u(&c["seed"]));
        assert_eq!(got, want, "randperm(n={}, seed={})", c["n"], c["seed"]);
    }
}

#[test]
fn every_sampler_case_matches_torch() {
    let g = golden();
    let cases = g["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 120);
    for c in cases {
        let mut s = DistributedSampler::new(
            u(&c["n"]),
            u(&c["num_replicas"]) as usize,
            u(&c["rank"]) as usize,
            c["shuffle"].as_bool().unwrap(),
            u(&c["seed"]),
            c["drop_last"].as_bool().unwrap(),
        )
        .unwrap();
        s.set_epoch(u(&c["epoch"]));
        let want: Vec<u64> = c["indices"].as_array().unwrap().iter().map(u).collect();
        assert_eq!(s.len() as usize, want.len(), "len of {c}");
        assert_eq!(
            s.indices().unwrap(),
            want,
            "case {}",
            serde_json::to_string(&{
                let mut c = c.clone();
                c["indices"] = Value::Null;
                c
            })
            .unwrap()
        );
    }
}
