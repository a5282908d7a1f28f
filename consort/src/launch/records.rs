//! The flight records that the ranks of a failed job wrote (`rank-K.json`,
//! see [`crate::flight`]), read from their directory, and the verdict on
//! them: who is behind and where. The agent prints it in its failure
//! summary; `consort debug flight DIR` prints it alone.

use std::path::Path;

use crate::flight::{Dump, analyze};

/// Every `rank-K.json` in `dir`, by rank.
pub fn read_records(dir: &Path) -> Result<Vec<Dump>, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| {
        format!(
            "cannot read the flight record directory {}: {e}",
            dir.display()
        )
    })?;
    let mut dumps = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !(name.starts_with("rank-") && name.ends_with(".json")) {
            continue;
        }
        let bytes = consort_comm::files::read_regular(&e.path(), 256 << 20)
            .map_err(|err| format!("cannot read {}: {err}", e.path().display()))?;
        // One damaged file (a worker killed mid-write) must not cost the
        // verdict on the others.
        match Dump::from_json(&bytes) {
            Ok(d) => dumps.push(d),
            Err(err) => eprintln!(
                "[consort] skipping {}: not a flight record ({err})",
                e.path().display()
            ),
        }
    }
    dumps.sort_by_key(|d| d.rank);
    Ok(dumps)
}

/// The verdict on `dir`'s records, one finding per line.
pub fn verdict(dir: &Path) -> Result<Vec<String>, String> {
    let dumps = read_records(dir)?;
    if dumps.is_empty() {
        return Err(format!(
            "{} holds no flight records (rank-K.json): did the job fail, and did its workers \
             run under `consort run` (or with CONSORT_FLIGHT_DIR set)?",
            dir.display()
        ));
    }
    let mut out = vec![format!(
        "{} flight record(s) from rank(s) {:?} of {}:",
        dumps.len(),
        dumps.iter().map(|d| d.rank).collect::<Vec<_>>(),
        dumps.iter().map(|d| d.world).max().unwrap_or(0)
    )];
    out.extend(analyze(&dumps));
    Ok(out)
}
