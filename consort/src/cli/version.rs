//! `consort version`: the version and the backends compiled in.

use serde_json::json;

/// `consort version`'s flags.
#[derive(Debug, clap::Args)]
pub(crate) struct VersionArgs {
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// Backends compiled into this build.
fn backends() -> Vec<&'static str> {
    vec!["sim", "tcp-store"]
}

/// Runs `consort version`.
pub(crate) fn run(a: VersionArgs) {
    let v = env!("CARGO_PKG_VERSION");
    if a.json {
        println!(
            "{}",
            json!({"name": "consort", "version": v, "backends": backends()})
        );
    } else {
        println!("consort {v} (backends: {})", backends().join(", "));
    }
}
