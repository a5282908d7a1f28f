//! Flag values shared by the subcommands: sizes (`4K,1G`), counts
//! (`25M`), dtypes, op lists, run counts and sampler modes.

use consort::{DType, OpKind};

/// `--iters`: at least one run (a median of none is undefined).
pub(crate) fn parse_iters(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("at least 1 timed run is needed (the median of no runs is undefined)".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{s:?} is not a whole number of runs")),
    }
}

#[derive(Debug, Clone)]
pub(crate) struct OpList(pub(crate) Vec<consort::OpKind>);

pub(crate) fn parse_op_list(s: &str) -> Result<OpList, String> {
    parse_ops(s).map(OpList)
}

#[derive(Debug, Clone)]
pub(crate) struct SizeList(pub(crate) Vec<usize>);

#[derive(Debug, Clone)]
pub(crate) struct DTypeList(pub(crate) Vec<DType>);

/// Parses `4K,64M,1G` (binary multiples) into byte counts.
pub(crate) fn parse_sizes(s: &str) -> Result<SizeList, String> {
    s.split(',')
        .map(|item| {
            let item = item.trim();
            let (num, mult) = match item.chars().last().map(|c| c.to_ascii_uppercase()) {
                Some('K') => (&item[..item.len() - 1], 1usize << 10),
                Some('M') => (&item[..item.len() - 1], 1 << 20),
                Some('G') => (&item[..item.len() - 1], 1 << 30),
                _ => (item, 1),
            };
            num.parse::<usize>()
                .ok()
                .and_then(|n| n.checked_mul(mult))
                .ok_or_else(|| format!("bad size {item:?}: expected a number with an optional K, M or G suffix, like 4K or 1G"))
        })
        .collect::<Result<_, _>>()
        .map(SizeList)
}

/// Parses a count with an optional decimal K or M suffix (`25M` is
/// 25,000,000, as model sizes are quoted).
pub(crate) fn parse_count(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (num, mult) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1_000usize),
        Some('M') => (&t[..t.len() - 1], 1_000_000),
        _ => (t, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| {
            format!("bad count {t:?}: expected a number with an optional K or M suffix, like 25M")
        })
}

/// Parses a comma-separated dtype list (`f32` or `float32` style).
pub(crate) fn parse_dtypes(s: &str) -> Result<DTypeList, String> {
    s.split(',')
        .map(|item| {
            let item = item.trim();
            DType::ALL
                .into_iter()
                .find(|d| {
                    d.name() == item || format!("{d:?}").eq_ignore_ascii_case(item)
                })
                .ok_or_else(|| format!("unknown dtype {item:?}: expected one of f32, f64, f16, bf16, i8, u8, i32, i64, u32, u64"))
        })
        .collect::<Result<_, _>>()
        .map(DTypeList)
}

pub(crate) fn parse_mode(s: &str) -> Result<consort::sampler::Mode, String> {
    match s {
        "exact" => Ok(consort::sampler::Mode::Exact),
        "streaming" => Ok(consort::sampler::Mode::Streaming),
        other => Err(format!(
            "unknown --mode {other:?}: expected exact or streaming"
        )),
    }
}

/// Refuses a run that would need more memory than this machine has
/// available (`MemAvailable` in /proc/meminfo), before anything is
/// allocated: `what` needs `bytes`. Where the figure cannot be read, only
/// what cannot be addressed at all is refused.
pub(crate) fn check_memory(what: &str, bytes: u128, smaller: &str) -> Result<(), String> {
    let gib = |b: u128| b as f64 / (1u128 << 30) as f64;
    let limit = available_memory().unwrap_or(isize::MAX as u128);
    if bytes > limit {
        return Err(format!(
            "{what} needs about {:.1} GiB of memory, and this machine has {:.1} GiB available: \
             {smaller}",
            gib(bytes),
            gib(limit)
        ));
    }
    Ok(())
}

/// This machine's `MemAvailable` (/proc/meminfo) in bytes, if it can be
/// read.
pub(crate) fn available_memory() -> Option<u128> {
    let m = std::fs::read_to_string("/proc/meminfo").ok()?;
    m.lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u128>().ok())
        .map(|kib| kib * 1024)
}

/// A figure given on the command line that must be finite and above zero
/// (a bandwidth), or at least zero with `zero_ok` (a latency, a cost).
pub(crate) fn check_positive(flag: &str, v: f64, zero_ok: bool) -> Result<(), String> {
    let ok = v.is_finite() && (v > 0.0 || (zero_ok && v == 0.0));
    if ok {
        return Ok(());
    }
    let want = if zero_ok {
        "a finite number, 0 or more"
    } else {
        "a finite number above 0"
    };
    Err(format!("{flag} {v}: expected {want}"))
}

/// Parses a comma-separated list of collective names (nccl-tests's ops).
pub(crate) fn parse_ops(s: &str) -> Result<Vec<OpKind>, String> {
    s.split(',')
        .map(|o| match o.trim() {
            "all_reduce" => Ok(OpKind::AllReduce),
            "broadcast" => Ok(OpKind::Broadcast),
            "reduce_scatter" => Ok(OpKind::ReduceScatter),
            "all_gather" => Ok(OpKind::AllGather),
            "all_to_all" | "all_to_all_single" => Ok(OpKind::AllToAll),
            other => Err(format!(
                "unknown op {other:?}: expected all_reduce, broadcast, reduce_scatter, all_gather or all_to_all"
            )),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_dtypes_parse() {
        assert_eq!(parse_sizes("4K,1G,7").unwrap().0, vec![4096, 1 << 30, 7]);
        assert!(parse_sizes("4X").is_err());
        assert!(parse_sizes("").is_err());
        assert!(parse_sizes("99999999999999999G").is_err());
        assert_eq!(
            parse_dtypes("f32,bfloat16").unwrap().0,
            vec![DType::F32, DType::BF16]
        );
        assert!(parse_dtypes("f8").unwrap_err().contains("unknown dtype"));
    }
}
